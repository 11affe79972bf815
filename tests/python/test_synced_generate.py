"""synced_generate.py: the engine's model.generate under data parallelism (Note [Generating on
every rank]). The two-rank run is test_data_parallel.py's
test_generate_of_different_lengths_on_each_rank_runs_as_under_zero3; here, which generates the
wrapper changes."""
from __future__ import annotations

import pytest

from patrickstar.synced_generate import synced_generate


def EVERY() -> bool:
    """Every rank generates (DataParallel.generates_alone's answer then)."""
    return False


def hugging_face_generate(inputs=None, generation_config=None, synced_gpus=None, **kwargs):
    return {"synced_gpus": synced_gpus, **kwargs}


def nanogpt_generate(idx, max_new_tokens, temperature=1.0, top_k=None):
    """nanoGPT's GPT.generate: no synced_gpus, no **kwargs."""
    return (idx, max_new_tokens, temperature, top_k)


def test_hugging_face_generate_defaults_to_synced_gpus():
    assert synced_generate(hugging_face_generate, EVERY)([1], max_new_tokens=3) == {
        "synced_gpus": True, "max_new_tokens": 3}


def test_an_explicit_false_is_made_true():
    # Hugging Face's Seq2SeqTrainer passes synced_gpus=False when it sees neither ZeRO-3 nor
    # FSDP; with sharded parameters ranks generating different lengths then hung.
    assert synced_generate(hugging_face_generate, EVERY)(synced_gpus=False)["synced_gpus"] is True
    assert synced_generate(hugging_face_generate, EVERY)(synced_gpus=True)["synced_gpus"] is True


def test_a_generate_without_synced_gpus_is_called_unchanged():
    # nanoGPT's sampling under torchrun (every rank samples the same number of tokens) raised
    # "unexpected keyword argument 'synced_gpus'" when the wrapper added it unconditionally.
    assert synced_generate(nanogpt_generate, EVERY)([1], 4, top_k=2) == ([1], 4, 1.0, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        synced_generate(nanogpt_generate, EVERY)([1], 4, foo=1)


def test_a_rank_generating_alone_runs_unsynced():
    # Note [Generating on one rank]: the other ranks serve its forwards, so the flag all-reduce
    # of synced_gpus, which they never make, must not run; an explicit True is overridden too.
    assert synced_generate(hugging_face_generate, lambda: True)()["synced_gpus"] is False
    assert synced_generate(hugging_face_generate, lambda: True)(
        synced_gpus=True)["synced_gpus"] is False
