"""Two engines in one training loop, as a GAN trains: the generator's loss runs through the
discriminator, whose gradients from it are dropped by its zero_grad() (PyTorch's DCGAN recipe).
Compared with the same loop on plain PyTorch modules; under 2-rank data parallelism
(two_engines_worker.py) with torch DDP models, the teacher-student pattern too (Note [Several
engines in one process] in process_engines.py)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar

CONFIG = {"default_chunk_size": 4096,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def generator():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))


def discriminator():
    return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


def gan_loop(gen, disc, gen_opt, disc_opt, backward, freeze_disc: bool, steps: int = 4):
    """DCGAN's loop; `backward(module, loss)`. Returns the losses."""
    generator_data = torch.Generator().manual_seed(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    losses = []
    for _ in range(steps):
        real = torch.randn(6, 16, generator=generator_data) + 2
        noise = torch.randn(6, 8, generator=generator_data)
        fake = gen(noise)
        disc_opt.zero_grad()
        d_loss = bce(disc(real), torch.ones(6, 1)) + bce(disc(fake.detach()), torch.zeros(6, 1))
        backward(disc, d_loss)
        disc_opt.step()
        if freeze_disc:
            disc.requires_grad_(False)
        gen_opt.zero_grad()
        g_loss = bce(disc(fake), torch.ones(6, 1))
        backward(gen, g_loss)
        gen_opt.step()
        if freeze_disc:
            disc.requires_grad_(True)
        losses += [d_loss.item(), g_loss.item()]
    return losses


@pytest.mark.parametrize("autograd", [False, True], ids=["model.backward", "loss.backward"])
@pytest.mark.parametrize("freeze_disc", [False, True])
def test_a_gan_of_two_engines_trains_as_pytorch(autograd, freeze_disc):
    torch.manual_seed(0)
    ref_gen, ref_disc = generator(), discriminator()
    ref_losses = gan_loop(ref_gen, ref_disc,
                          torch.optim.AdamW(ref_gen.parameters(), lr=1e-2, weight_decay=0.0),
                          torch.optim.AdamW(ref_disc.parameters(), lr=1e-2, weight_decay=0.0),
                          lambda module, loss: loss.backward(), freeze_disc)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen, gen_opt = patrickstar.initialize(generator, config=CONFIG)
        disc, disc_opt = patrickstar.initialize(discriminator, config=CONFIG)
    if autograd:
        backward = lambda module, loss: loss.backward()  # noqa: E731
    else:
        backward = lambda module, loss: module.backward(loss)  # noqa: E731
    losses = gan_loop(gen, disc, gen_opt, disc_opt, backward, freeze_disc)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for ours, ref in ((gen, ref_gen), (disc, ref_disc)):
        for name, tensor in ref.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[name], tensor, rtol=0, atol=1e-5)


# ---- Under data parallelism (2 ranks): two_engines_worker.py, against torch DDP -------------

def _launch_two_engines(tmp_path, what: str, transport: str = "auto", steps: int = 3,
                        backward: str = "model") -> list[dict]:
    import os

    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_engines_worker.py")
    return launch(tmp_path, 2, what, transport, str(steps), backward, worker=worker)


def _assert_trains_as_ddp(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"
        assert result["losses"] == pytest.approx(result["ddp_losses"], abs=1e-5), rank
        for ours, ddp in zip(result["states"], result["ddp_states"]):
            for name, tensor in ddp.items():
                torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backward", ["model", "autograd"])
def test_a_gan_of_two_engines_trains_as_ddp_with_reads_on_one_rank(tmp_path, backward):
    # Rank 0 alone logs, saves and evaluates the discriminator before each step's generator
    # forward. Each engine agreed on its own communicator: rank 0 waited in the
    # discriminator's agreement, rank 1 in the generator's, both until the collective timeout.
    # Now the process's engines share one agreement (Note [Several engines in one process] in
    # process_engines.py) and rank 1 serves the read whichever engine its next call is.
    results = _launch_two_engines(tmp_path, "gan_read", backward=backward)
    _assert_trains_as_ddp(results)
    reads, ddp_reads = results[0]["reads"], results[0]["ddp_reads"]
    assert len(reads) == len(ddp_reads) == 9 and results[1]["reads"] == []
    for ours, ddp in zip(reads, ddp_reads):
        torch.testing.assert_close(ours, ddp, rtol=0, atol=1e-5)


def test_a_gan_of_two_engines_over_process_groups_trains_as_ddp(tmp_path):
    # Both engines' communicators ran over the same process groups, each from its own thread:
    # in the generator's loss through the discriminator their collectives reached gloo in an
    # order that differed between the ranks and it paired one engine's chunks with the
    # other's (weights off by ~0.2 within 20 steps, no error). Each engine now has groups of
    # its own (Note [Several engines in one process]). A race: 20 steps make it show.
    _assert_trains_as_ddp(_launch_two_engines(tmp_path, "gan", "process_group", steps=20))


def test_a_student_beside_an_evaluating_teacher_trains_as_ddp(tmp_path):
    _assert_trains_as_ddp(_launch_two_engines(tmp_path, "teacher"))


def test_a_gan_with_the_discriminator_frozen_for_the_generator_step_trains_as_ddp(tmp_path):
    # pix2pix's set_requires_grad(netD, False): the generator's loss runs through a
    # discriminator whose parameters get no gradient (DDP needs find_unused_parameters).
    _assert_trains_as_ddp(_launch_two_engines(tmp_path, "gan_freeze"))


def test_reads_of_different_engines_on_different_ranks_are_both_served(tmp_path):
    # Two reads at once, one per engine: rank 0's is served first, then rank 1's at rank 0's
    # next call (Note [Reads on one rank are served] in data_parallel.py). Before, both ranks
    # raised "not making the same call", though each read alone would have been served.
    results = _launch_two_engines(tmp_path, "reads_differ")
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("traceback")
        read = result["ddp_states"][1 if rank == 0 else 0]["0.weight"]
        assert result["norm"] == pytest.approx(read.norm().item(), rel=1e-6)
        for ours, reference in zip(result["states"], result["ddp_states"]):
            for key, tensor in reference.items():
                torch.testing.assert_close(ours[key], tensor)


class _Party:
    """A stand-in for an engine's DataParallel in process_engines' registry."""

    def __init__(self, data_ranks):
        self.data_ranks = data_ranks


def test_slots_and_the_leader_follow_what_every_rank_holds(monkeypatch):
    # Note [Several engines in one process]: an engine still uncollected on this rank alone
    # (slot 0 busy here, free on the other rank) keeps its slot but leads nothing, so every
    # rank agrees on the new engine's communicator.
    from patrickstar import process_engines
    monkeypatch.setattr(process_engines, "_SLOTS", {})
    monkeypatch.setattr(process_engines, "_EVERYWHERE", set())
    monkeypatch.setattr(process_engines, "_calls", 0)
    lingering, first, second = _Party([0, 1]), _Party([0, 1]), _Party([0, 1])
    assert process_engines.take_slot(lingering, [[], []], [0, 1]) == 0
    assert process_engines.take_slot(first, [[0], []], [0, 1]) == 1
    assert process_engines.leader() is first
    assert process_engines.take_slot(second, [[0, 1], [1]], [0, 1]) == 2
    assert process_engines.leader() is first
    process_engines.release(1)
    assert process_engines.leader() is second
    assert process_engines.parties() == [lingering, second]


def test_engines_of_different_data_groups_in_one_process_are_refused(monkeypatch):
    # Their agreements share one communicator, which spans one data group.
    from patrickstar import process_engines
    monkeypatch.setattr(process_engines, "_SLOTS", {})
    monkeypatch.setattr(process_engines, "_EVERYWHERE", set())
    monkeypatch.setattr(process_engines, "_calls", 0)
    live = _Party([0, 1])
    process_engines.take_slot(live, [[], []], [0, 1])
    with pytest.raises(RuntimeError, match=r"same data-parallel group.*\[0, 1\].*\[0, 2\]"):
        process_engines.take_slot(_Party([0, 2]), [[0], [0]], [0, 2])
