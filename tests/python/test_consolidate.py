"""patrickstar-consolidate: checkpoints as plain PyTorch state_dicts (issue 10)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import patrickstar
from patrickstar.consolidate import consolidate, main
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches


def gpt_config():
    return GPTConfig(vocab_size=128, max_seq_len=16, hidden=32, layers=2, heads=2)


def trained(build, config, batches, steps=2, **kwargs):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(build, config=config)
    for batch in batches(steps):
        loss = model(*batch, **kwargs)
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        model.backward(loss)
        opt.step()
        opt.zero_grad()
    return model, opt


def gpt_batches(steps):
    return synthetic_batches(gpt_config(), batch=4, steps=steps)


def test_fp32_consolidated_gpt_reproduces_our_forward(tmp_path):
    cfg = gpt_config()
    model, _ = trained(lambda: GPT(cfg), {"default_chunk_size": 8192}, gpt_batches)
    model.save_checkpoint(tmp_path / "ckpt")
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 0
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    plain = GPT(cfg)
    plain.load_state_dict(state)  # strict: exactly the plain model's keys
    assert state["head.weight"].data_ptr() == state["tokens.weight"].data_ptr()  # still tied
    model.eval(), plain.eval()
    x, _ = next(synthetic_batches(cfg, batch=4, steps=1, seed=3))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x), rtol=0, atol=1e-6)
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16bit_runs_give_their_exact_16bit_weights_and_fp32_masters(tmp_path, precision, dtype):
    cfg = gpt_config()
    config = {"default_chunk_size": 8192, precision: {"enabled": True}}
    if precision == "fp16":
        config["fp16"]["initial_scale_power"] = 8
    model, _ = trained(lambda: GPT(cfg), config, gpt_batches)
    sixteen = model.state_dict()
    assert all(v.dtype == dtype for k, v in sixteen.items())  # state_dict(): 16-bit weights
    model.save_checkpoint(tmp_path / "ckpt", tag="t")
    consolidate(tmp_path / "ckpt", tmp_path / "half.pt", dtype=precision, tag="t")
    consolidate(tmp_path / "ckpt", tmp_path / "full.pt", dtype="fp32")
    half = torch.load(tmp_path / "half.pt", weights_only=True)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    for key, value in sixteen.items():
        assert half[key].dtype == dtype and torch.equal(half[key], value), key
        assert full[key].dtype == torch.float32
        # The master is the fp32 value the 16-bit weight was rounded from.
        assert torch.equal(full[key].to(dtype), value), key
    assert any(not torch.equal(full[k], full[k].to(dtype).float()) for k in full)


def test_a_run_without_master_and_8bit_state_consolidates_to_its_bf16_weights(tmp_path):
    # No fp32 master and 8-bit moments (issue 21): the plain weights are the bf16 params; the
    # compensation, codes and scales stay in the checkpoint.
    cfg = gpt_config()
    config = {"default_chunk_size": 8192, "bf16": {"enabled": True, "master_weights": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "state_dtype": "int8"}}}
    model, _ = trained(lambda: GPT(cfg), config, gpt_batches)
    weights = model.state_dict()
    model.save_checkpoint(tmp_path / "ckpt", tag="t")
    model.destroy()
    consolidate(tmp_path / "ckpt", tmp_path / "full.pt", dtype="fp32", tag="t")
    consolidate(tmp_path / "ckpt", tmp_path / "half.pt", dtype="bf16", tag="t")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    half = torch.load(tmp_path / "half.pt", weights_only=True)
    assert full.keys() == weights.keys()
    for key, value in weights.items():
        assert full[key].dtype == torch.float32 and torch.equal(full[key], value.float()), key
        assert torch.equal(half[key], value), key
    plain = GPT(cfg)
    plain.load_state_dict(full)


def test_huggingface_gpt2_names_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128,
                                        n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

    def build():
        return transformers.GPT2LMHeadModel(hf_config)

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model, _ = trained(build, {"default_chunk_size": 16384}, lambda n: [(ids,)] * n,
                       labels=ids)
    model.save_checkpoint(tmp_path / "ckpt")
    consolidate(tmp_path / "ckpt", tmp_path / "hf.pt")
    state = torch.load(tmp_path / "hf.pt", weights_only=True)
    plain = build()
    assert set(state) == set(plain.state_dict())  # Hugging Face's own names
    plain.load_state_dict(state)
    model.eval(), plain.eval()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, ours, rtol=0, atol=1e-6)
    # ... and back into a fresh engine through load_state_dict, then a checkpoint again.
    fresh, _ = trained(build, {"default_chunk_size": 16384}, lambda n: [], steps=0)
    fresh.load_state_dict(state)
    fresh.save_checkpoint(tmp_path / "again")
    consolidate(tmp_path / "again", tmp_path / "hf2.pt")
    again = torch.load(tmp_path / "hf2.pt", weights_only=True)
    for key, value in state.items():
        assert torch.equal(again[key], value), key


def test_consolidation_streams_without_holding_the_model(tmp_path):
    # 16.8M fp32 parameters (64 MiB of weights, 192 MiB of shard with Adam state). A
    # subprocess's peak RSS grows by far less than the model while consolidating.
    code = f"""
import resource, sys, torch, patrickstar
from torch import nn
from patrickstar.consolidate import consolidate
model, opt = patrickstar.initialize(lambda: nn.Linear(4096, 4096, bias=False),
                                    config={{"default_chunk_size": 4096 * 4096}})
model.save_checkpoint({str(tmp_path)!r}, tag="t")
del model, opt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
consolidate({str(tmp_path)!r}, {str(tmp_path / 'out.pt')!r}, dtype="fp32")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.split()[-1])
    model_bytes = 4096 * 4096 * 4
    # One tensor here is the whole model, so ~1x is the floor; holding shard + output at once
    # (what torch.load + torch.save would do) would be >= 2x.
    assert growth < 1.5 * model_bytes, growth
    state = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    assert state["weight"].shape == (4096, 4096)


def test_console_script_and_errors(tmp_path):
    cfg = gpt_config()
    model, _ = trained(lambda: GPT(cfg), {"default_chunk_size": 8192}, gpt_batches, steps=1)
    model.save_checkpoint(tmp_path / "ckpt", tag="only")
    script = shutil.which("patrickstar-consolidate",
                          path=os.path.dirname(sys.executable) + os.pathsep
                          + os.environ.get("PATH", ""))
    assert script is not None, "the [project.scripts] entry point is not installed"
    done = subprocess.run([script, str(tmp_path / "ckpt"), str(tmp_path / "o.pt"), "--dtype",
                           "bf16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "from tag only" in done.stdout
    assert torch.load(tmp_path / "o.pt")["tokens.weight"].dtype == torch.bfloat16
    shard = tmp_path / "ckpt" / "only" / "rank_00000.shard"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "bad.pt")]) == 1
    assert not (tmp_path / "bad.pt").exists()
    assert main([str(tmp_path / "nothing"), str(tmp_path / "bad.pt")]) == 1


def test_bad_paths_are_named_before_any_work(tmp_path, capsys):
    # A user's slips at the command line: each must exit 1 with one line naming the path, not
    # a traceback from torch.save or os.replace after the shards were read.
    cfg = gpt_config()
    model, _ = trained(lambda: GPT(cfg), {"default_chunk_size": 8192}, gpt_batches, steps=1)
    model.save_checkpoint(tmp_path / "ckpt", tag="t1")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "file.txt").write_text("x")
    cases = [
        ([str(tmp_path / "ckpt"), str(tmp_path / "missing" / "o.pt")],
         f"output directory '{tmp_path / 'missing'}' does not exist"),
        ([str(tmp_path / "ckpt"), str(tmp_path / "outdir")],
         f"output '{tmp_path / 'outdir'}' is a directory"),
        ([str(tmp_path / "nothing"), str(tmp_path / "o.pt")],
         f"checkpoint directory '{tmp_path / 'nothing'}' does not exist"),
        ([str(tmp_path / "file.txt"), str(tmp_path / "o.pt")],
         f"checkpoint directory '{tmp_path / 'file.txt'}' is not a directory"),
        ([str(tmp_path / "ckpt" / "t1"), str(tmp_path / "o.pt")],
         f"give its parent '{tmp_path / 'ckpt'}' and tag 't1'"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert sorted(os.listdir(tmp_path / "outdir")) == []
    assert not (tmp_path / "o.pt").exists()
    # The hint names what works: the parent and the tag.
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "o.pt"), "--tag", "t1"]) == 0
