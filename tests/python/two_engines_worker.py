"""One rank of test_two_engines.py's data-parallel tests: two engines in one process, each
rank on its half of every batch, and the same loop on two torch DDP models first.

    two_engines_worker.py OUT_DIR WHAT TRANSPORT STEPS [BACKWARD]

WHAT: gan (DCGAN's loop, as test_two_engines.py's), gan_freeze (the discriminator frozen for
the generator's step), gan_read (the same, rank 0 alone also
reading the discriminator's weight norm and state dict and evaluating it before the generator's
forward of every step, then a barrier on every rank, as a DDP script logs and saves), teacher (a
student trained on a teacher's outputs, the teacher in eval() under no_grad) or reads_differ
(rank 0 reads the discriminator while rank 1 reads the generator: both served). TRANSPORT is
parallel.transport; BACKWARD "model" (model.backward(loss), the default) or "autograd"
(loss.backward()).

Writes OUT_DIR/rank<r>.pt with DDP's and the engines' losses, reads and final weights.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import patrickstar
from dp_worker import error_result, save_and_exit


def generator():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))


def discriminator():
    return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


def teacher():
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def student():
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def config(transport: str) -> dict:
    return {"default_chunk_size": 4096,
            # Short: without Note [Several engines in one process] a rank-0 read waited for it.
            "parallel": {"collective_timeout": 10, "transport": transport},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def gan_loop(gen, disc, gen_opt, disc_opt, rank, steps, backward, lonely_read=None,
             freeze=False) -> list[float]:
    """DCGAN's loop on this rank's half of each batch; `backward(module, loss)`;
    `lonely_read(real)` on rank 0 alone before each step's generator forward, then a barrier;
    `freeze`: the discriminator frozen for the generator's step (pix2pix's set_requires_grad)."""
    data = torch.Generator().manual_seed(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    losses = []
    for _ in range(steps):
        real = (torch.randn(12, 16, generator=data) + 2).chunk(2)[rank]
        noise = torch.randn(12, 8, generator=data).chunk(2)[rank]
        if lonely_read is not None:
            if rank == 0:
                lonely_read(real)
            dist.barrier()
        fake = gen(noise)
        disc_opt.zero_grad()
        d_loss = bce(disc(real), torch.ones(6, 1)) + bce(disc(fake.detach()), torch.zeros(6, 1))
        backward(disc, d_loss)
        disc_opt.step()
        gen_opt.zero_grad()
        if freeze:
            disc.requires_grad_(False)
        g_loss = bce(disc(fake), torch.ones(6, 1))
        backward(gen, g_loss)
        gen_opt.step()
        if freeze:
            disc.requires_grad_(True)
        losses += [d_loss.item(), g_loss.item()]
    return losses


def distillation_loop(teach, stud, opt, rank, steps, backward) -> list[float]:
    data = torch.Generator().manual_seed(2)
    losses = []
    teach.eval()
    for _ in range(steps):
        x = torch.randn(12, 16, generator=data).chunk(2)[rank]
        with torch.no_grad():
            target = teach(x).softmax(-1)
        loss = nn.functional.cross_entropy(stud(x), target)
        opt.zero_grad()
        backward(stud, loss)
        opt.step()
        losses.append(loss.item())
    return losses


def adamw(module):
    return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.0)


def reader(disc, evaluate, reads: list):
    """Logging, a save and an evaluation of the discriminator (`disc` its nn.Module)."""
    def lonely_read(real):
        reads.append(disc[0].weight.norm().item())
        reads.append(disc.state_dict()["2.bias"].clone())
        with torch.no_grad():
            reads.append(evaluate(real).mean().item())
    return lonely_read


def main() -> None:
    out, what, transport, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    autograd = sys.argv[5:] == ["autograd"]
    rank = int(os.environ["RANK"])
    warnings.simplefilter("ignore")
    result = {}
    try:
        dist.init_process_group("gloo")
        reference_backward = lambda module, loss: loss.backward()  # noqa: E731
        engine_backward = reference_backward if autograd else (
            lambda module, loss: module.backward(loss))
        first, second = (teacher, student) if what == "teacher" else (generator, discriminator)
        torch.manual_seed(0)
        # Frozen for the generator's step, the discriminator's parameters get no gradient there,
        # which DDP allows only with find_unused_parameters.
        ref_first, ref_second = DDP(first()), DDP(second(),
                                                  find_unused_parameters=what == "gan_freeze")
        result["ddp_reads"] = []
        if what == "teacher":
            result["ddp_losses"] = distillation_loop(
                ref_first, ref_second, adamw(ref_second), rank, steps, reference_backward)
        elif what != "reads_differ":
            result["ddp_losses"] = gan_loop(
                ref_first, ref_second, adamw(ref_first), adamw(ref_second), rank, steps,
                reference_backward, reader(ref_second.module, ref_second.module,
                                           result["ddp_reads"]) if what == "gan_read" else None,
                what == "gan_freeze")
        result["ddp_states"] = [ref_first.module.state_dict(), ref_second.module.state_dict()]
        torch.manual_seed(0)
        one, one_opt = patrickstar.initialize(first, config=config(transport))
        two, two_opt = patrickstar.initialize(second, config=config(transport))
        result["reads"] = []
        if what == "teacher":
            result["losses"] = distillation_loop(one, two, two_opt, rank, steps, engine_backward)
        elif what == "reads_differ":
            result["norm"] = (two if rank == 0 else one).module[0].weight.norm().item()
            # rank 0's read is served first; rank 1's at rank 0's next call that is no read
            # (a script's own exit with os._exit, below, would serve nothing)
            dist.barrier()
        else:
            result["losses"] = gan_loop(
                one, two, one_opt, two_opt, rank, steps, engine_backward,
                reader(two.module, two, result["reads"]) if what == "gan_read" else None,
                what == "gan_freeze")
        result["states"] = [one.state_dict(), two.state_dict()]
    except BaseException as error:  # noqa: BLE001 (reported to the test)
        result.update(error_result(error))
    save_and_exit(out, rank, result)


if __name__ == "__main__":
    main()
