"""Training loops whose iterations differ from the warm-up one, against the same loops on the
plain module with torch.optim.AdamW, under a tight device and host budget with NVMe: an
evaluation before the first step and a model that runs fewer modules after the warm-up (Note
[The trace forecasts, the report bounds] in chunk/chunk_manager_placement.cc), and shapes that
change from step to step as real loops have them (a last partial batch, a batch larger than
any of the warm-up, a length curriculum, evaluation batches larger than training ones, uneven
accumulated micro-batches, Hugging Face's dynamic padding)."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar import _C

KiB = 1024
CHUNK = 4096  # elements: 16 KiB fp32 chunks
WIDTH, BATCH = 64, 256
# What autograd saves for the 8 tanh layers and the head at BATCH (the engine's CPU measure of
# non-model data): 9 tensors of BATCH x WIDTH fp32.
ACTIVATIONS = 9 * BATCH * WIDTH * 4


class Deep(nn.Module):
    """Linear + tanh layers of which a forward runs the first `depth` (an early exit)."""

    def __init__(self, layers: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x, y, depth: int = 8):
        for layer in self.layers[:depth]:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), y)


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randint(0, 10, (BATCH,), generator=generator))


def run(model, optimizer, schedule, engine: bool) -> list[float]:
    """`schedule`: (depth, "train" or "eval") per call; an optimizer step after each train."""
    losses = []
    for seed, (depth, kind) in enumerate(schedule):
        x, y = batch(seed)
        if kind == "eval":
            model.eval()
            with torch.no_grad():
                losses.append(model(x, y, depth).item())
            model.train()
            continue
        losses.append(_step(model, optimizer, model(x, y, depth), engine))
    return losses


def _step(model, optimizer, loss, engine: bool) -> float:
    """One training step from `loss`: the engine's backward or torch's; the loss's value."""
    if engine:
        model.backward(loss)
    else:
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


SCHEDULES = {
    # nanoGPT's and the Trainer's (eval_on_start) evaluation before training: its forward's
    # moments are in the warm-up trace, so every later step ran at the moment the trace had at
    # the training forward's activation peak.
    "evaluation first": [(8, "eval")] + [(8, "train")] * 3,
    # Fewer modules after the warm-up: the step of a depth-4 iteration ran at the moment of the
    # depth-8 warm-up's activation peak.
    "shorter later": [(8, "train"), (4, "train"), (4, "train")],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_iterations_unlike_the_warmup_train_in_the_budget_training_needs(schedule, tmp_path):
    # Room for the activations' peak and two chunks: every step of a loop that repeats the
    # warm-up fits; the ones above raised "cannot take 16384 bytes: budget 623104 bytes,
    # non-model data 589824 bytes" at the optimizer step, with no activation left.
    config = {"default_chunk_size": CHUNK,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "memory": {"device_budget": 4 * CHUNK * 4,
                         "host_budget": ACTIVATIONS + 2 * CHUNK * 4 + 512,
                         "nvme": {"path": str(tmp_path)}}}
    torch.manual_seed(0)
    module = Deep()
    reference = copy.deepcopy(module)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = run(reference, torch_optimizer, SCHEDULES[schedule], engine=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(module), config=config)
    got = run(model, optimizer, SCHEDULES[schedule], engine=True)
    assert got == pytest.approx(expected, rel=1e-5)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6, msg=name)
    host = next(t for t in model.memory_stats() if t["name"] == "host")
    assert host["peak_chunk_bytes"] <= config["memory"]["host_budget"]
    model.destroy()


def test_the_trace_keeps_room_but_only_the_report_refuses_an_access():
    device = _C.EmulatedDeviceTier(budget=3 * 16 * KiB, slab_bytes=16 * KiB)
    host = _C.HostTier(slab_bytes=16 * KiB)
    manager = _C.ChunkManager([device, host], _C.CopyEngine())
    ids = [manager.register_tensor(f"t{i}", [64, 64], _C.ChunkKind.COMPUTE_PARAM, "fp32")
           for i in range(3)]
    manager.build_chunk_lists(4096)
    # Warm-up: two chunks of activations at moment 1, beside one chunk in use.
    manager.tick()
    manager.report_non_model_data("device", 2 * 16 * KiB)
    manager.access(ids[0], "device")
    manager.release(ids[0], _C.TensorState.HOLD)
    manager.report_non_model_data("device", 0)
    manager.end_iteration()
    # A later iteration's moment 1 is another point of the model: no activations, three chunks
    # in use at once. The forecast cannot be kept (nothing to evict), the budget can.
    manager.tick()
    manager.report_non_model_data("device", 0)
    for t in ids:
        manager.access(t, "device")
    assert json.loads(manager.dump_json())["tiers"][0]["chunk_bytes"] == 3 * 16 * KiB
    # Activations that really are there still bound the tier, and the error names them.
    with pytest.raises(patrickstar.ChunkOutOfMemoryError,
                       match="minus non-model data 16384 bytes leaves 32768 bytes"):
        manager.report_non_model_data("device", 16 * KiB)


# ---- Shapes that change from step to step, as real loops have them ---------------------------

VOCAB = 96


def tokens(batch_size: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, length),
                         generator=torch.Generator().manual_seed(seed))


# (kind, [(batch, length) of each micro-batch]): "train" steps after its micro-batches, "eval"
# runs them under torch.no_grad().
LOOPS = {
    "last partial batch": [("train", [(4, 16)])] * 2 + [("train", [(1, 16)])],
    # A warm-up of small batches, then a batch larger than anything it saw.
    "batch growth": [("train", [(1, 8)])] * 2 + [("train", [(24, 32)]), ("train", [(2, 8)])],
    "length curriculum": [("train", [(4, 4)])] * 2 + [("train", [(4, 24)]), ("train", [(12, 63)])],
    "eval larger than train": [("train", [(2, 8)]), ("eval", [(32, 48)]), ("train", [(2, 8)])],
    "uneven accumulation": [("train", [(1, 8), (12, 60)]), ("train", [(10, 63), (1, 3)])],
}


def gpt_loop(model, optimizer, loop, engine: bool, accumulation: int) -> list[float]:
    losses, seed = [], 0
    for kind, micro_batches in loop:
        for batch_size, length in micro_batches:
            ids = tokens(batch_size, length + 1, seed)
            seed += 1
            inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            if kind == "eval":
                model.eval()
                with torch.no_grad():
                    losses.append(model(inputs, targets).item())
                model.train()
                continue
            loss = model(inputs, targets)
            if engine:
                model.backward(loss)  # divides by gradient_accumulation_steps
            else:
                (loss / accumulation).backward()
            losses.append(loss.item())
        if kind == "train":
            optimizer.step()
            optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("loop", LOOPS)
def test_changing_shapes_train_like_pytorch_in_a_tight_budget_with_nvme(loop, tmp_path):
    from patrickstar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    module = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=64, hidden=32, layers=2, heads=4))
    accumulation = len(LOOPS[loop][0][1])
    reference = copy.deepcopy(module)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = gpt_loop(reference, torch_optimizer, LOOPS[loop], False, accumulation)
    # Four chunks on the device, and a host budget under the largest batch's activations plus
    # the optimizer state: chunks spill to NVMe as the batches grow.
    config = {"default_chunk_size": CHUNK, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "memory": {"device_budget": 4 * CHUNK * 4, "host_budget": 3400 * KiB,
                         "nvme": {"path": str(tmp_path)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(module), config=config)
    got = gpt_loop(model, optimizer, LOOPS[loop], True, accumulation)
    assert got == pytest.approx(expected, rel=1e-5)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        mine = trained[name]
        if name.endswith("qkv.bias"):
            # The key bias's gradient is zero up to rounding (softmax ignores a shift shared by
            # all keys), which Adam scales up to whole steps of noise: compare query and value.
            mine, value = (torch.cat([t[:32], t[64:]]) for t in (mine, value))
        torch.testing.assert_close(mine, value, rtol=1e-4, atol=1e-5, msg=name)
    model.destroy()


def test_dynamic_padding_of_hugging_face_trains_like_pytorch(tmp_path):
    """DataCollatorForLanguageModeling pads each batch to its longest sequence: every step has
    another length, and the last batch of the epoch is short (drop_last=False)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(4, VOCAB, (int(length),), generator=generator).tolist()}
               for length in torch.randint(3, 40, (14,), generator=generator)]
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    module = transformers.LlamaForCausalLM(config)

    def train(model, optimizer, engine):
        losses = []
        for batch in torch.utils.data.DataLoader(samples, batch_size=4, collate_fn=collator):
            losses.append(_step(model, optimizer, model(**batch).loss, engine))
        return losses

    reference = copy.deepcopy(module)
    expected = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                                  weight_decay=0.01), False)
    engine_config = {"default_chunk_size": CHUNK,
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                     "memory": {"device_budget": 4 * CHUNK * 4, "host_budget": "2MiB",
                                "nvme": {"path": str(tmp_path)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(module),
                                                  config=engine_config)
    got = train(model, optimizer, True)
    assert len(got) == 4  # 4 + 4 + 4 + 2 samples
    assert got == pytest.approx(expected, rel=1e-5)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)
    model.destroy()
