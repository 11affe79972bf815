"""Hugging Face's training loops around the engine, against the same loops around the plain
model: accelerate's custom loop (the `run_clm_no_trainer.py` recipe) and the `Trainer` with the
two settings the README names (`remove_unused_columns=False`, `label_names=["labels"]`),
including its checkpoint save and resume."""
from __future__ import annotations

import copy

import pytest
import torch

import patrickstar

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

VOCAB = 96


def _llama(tie: bool = False):
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, index):
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _engine(module, lr=1e-2, accumulation=1):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
              "gradient_accumulation_steps": accumulation}
    return patrickstar.initialize(lambda: copy.deepcopy(module), config=config)


def _accelerate_losses(model, optimizer):
    accelerator = accelerate.Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, accelerator


def test_accelerate_loop_matches_the_plain_model():
    module = _llama(tie=True)  # GPT-2-style tied embedding and head
    reference = copy.deepcopy(module)
    expected, _ = _accelerate_losses(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0))
    model, optimizer = _engine(module)
    got, accelerator = _accelerate_losses(model, optimizer)
    assert got == pytest.approx(expected, rel=1e-4)
    assert got[-1] < got[0]
    weights = accelerator.get_state_dict(model)  # real values, as the plain model's
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5)


def _trainer(model, optimizer, out_dir, max_steps, save_steps=None, accumulation=1):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=max_steps,
        report_to=[], use_cpu=True, max_grad_norm=0.5, logging_steps=1, seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        remove_unused_columns=False, label_names=["labels"])
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                eval_dataset=_Tokens(), optimizers=(optimizer, None))


def _train_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_trains_evaluates_saves_and_resumes_as_the_plain_model(tmp_path):
    module = _llama(tie=False)  # Trainer writes a plain module's state dict by safetensors,
    # which refuses tied tensors (README): an untied Llama, as Llama-2's.
    reference = copy.deepcopy(module)
    plain = _trainer(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                                  weight_decay=0.0), tmp_path / "plain", 4)
    plain.train()
    model, optimizer = _engine(module)
    ours = _trainer(model, optimizer, tmp_path / "ours", 4, save_steps=2)
    ours.train()
    assert _train_losses(ours) == pytest.approx(_train_losses(plain), rel=1e-4)
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-4)

    # A new engine resumed from the step-2 checkpoint ends where the uninterrupted run did.
    resumed_model, resumed_optimizer = _engine(_llama(tie=False))
    resumed = _trainer(resumed_model, resumed_optimizer, tmp_path / "ours", 4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    assert _train_losses(resumed)[-2:] == pytest.approx(_train_losses(ours)[-2:], rel=1e-5)
    finished = model.state_dict()
    for name, value in resumed_model.state_dict().items():
        torch.testing.assert_close(value, finished[name], rtol=1e-5, atol=1e-6)


def test_trainer_accumulates_as_the_plain_model_with_the_key_in_the_config(tmp_path):
    module = _llama(tie=False)
    reference = copy.deepcopy(module)
    plain = _trainer(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                                  weight_decay=0.0), tmp_path / "plain", 3,
                     accumulation=2)
    plain.train()
    model, optimizer = _engine(module, accumulation=2)
    ours = _trainer(model, optimizer, tmp_path / "ours", 3, accumulation=2)
    ours.train()
    assert _train_losses(ours) == pytest.approx(_train_losses(plain), rel=1e-4)


@pytest.mark.parametrize("config_bf16", [False, True])
def test_accelerates_mixed_precision_unlike_the_configs_is_named_once(config_bf16):
    """Note [accelerate's mixed precision on the engine]: accelerate's autocast does not apply
    to the engine, so `mixed_precision="bf16"` (TrainingArguments(bf16=True)) with an fp32
    config trained in fp32 silently."""
    import warnings
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if config_bf16:
        config["bf16"] = {"enabled": True}
    model, optimizer = patrickstar.initialize(lambda: torch.nn.Linear(4, 4), config=config)
    accelerate.state.AcceleratorState._reset_state(True)
    try:
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared, _ = accelerator.prepare(model, optimizer)
            accelerator.prepare(model)  # again: said once
    finally:
        accelerate.state.AcceleratorState._reset_state(True)
    assert prepared is model
    named = [str(w.message) for w in caught if "mixed_precision='bf16'" in str(w.message)]
    if config_bf16:
        assert named == []
    else:
        assert len(named) == 1 and "'bf16': {'enabled': true}" in named[0], named
    model.destroy()


def test_trainer_under_data_parallelism_saves_checkpoints_and_the_final_model(tmp_path):
    # The Trainer saves checkpoints (model.state_dict(), optimizer.state_dict()) and the final
    # model (trainer.save_model()) on the main process only: with the parameters sharded these
    # raised "the ranks are not making the same call". Note [Reads on one rank are served]:
    # rank 1's next forward serves a checkpoint, its engine's end the final save (rank 1's
    # script ends right after train(), as run_clm.py's does without do_eval).
    import os

    import safetensors.torch

    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_dp_worker.py")
    results = launch(tmp_path, 2, worker=worker)
    assert (tmp_path / "saved").exists(), "rank 0's final save_model() did not finish"
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 4
    every = results[0]["every"]
    for rank in range(2):
        for name, value in results[rank]["every"].items():
            torch.testing.assert_close(value, every[name], rtol=0, atol=0)
    for saved in ("final", "run/checkpoint-4"):
        weights = safetensors.torch.load_file(tmp_path / saved / "model.safetensors")
        assert weights.keys() == every.keys(), saved
        for name, value in every.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    state = torch.load(tmp_path / "run/checkpoint-2/optimizer.pt", weights_only=False)
    trainable = sum(1 for _ in _llama(tie=False).parameters())
    assert len(state["state"]) == trainable
    assert all(entry["exp_avg"].abs().sum() > 0 for entry in state["state"].values())


def test_a_final_save_after_the_other_rank_stopped_waiting_names_the_barrier(tmp_path):
    # Rank 1's engine, at its script's end, serves reads for END_WAIT_S per call (1 s here);
    # rank 0 reads after that: nobody is left to serve it, and the error says what to add.
    import os

    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_dp_worker.py")
    launch(tmp_path, 2, "late", worker=worker)
    assert not (tmp_path / "error1").exists()
    error = (tmp_path / "error0").read_text()
    assert "state_dict()" in error and "torch.distributed.barrier()" in error, error
