"""One rank of test_two_engines.py's data-parallel tests: two engines in one process, each
rank on its half of every batch, and the same loop on two torch DDP models first.

    two_engines_worker.py OUT_DIR gan [TRANSPORT]      DCGAN's loop (Note in test_two_engines.py)
    two_engines_worker.py OUT_DIR gan_read [TRANSPORT] the same, rank 0 alone also reading the
                                                       discriminator (logging, a state dict) and
                                                       evaluating it before the generator's
                                                       forward of every step
    two_engines_worker.py OUT_DIR teacher [TRANSPORT]  a student trained on a teacher's outputs
                                                       (the teacher in eval(), under no_grad)

Writes OUT_DIR/rank<r>.pt with DDP's and the engines' losses and final weights.
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

STEPS = int(os.environ.get("STEPS", 3))


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
            "parallel": {"collective_timeout": 20, "transport": transport},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def gan_loop(gen, disc, gen_opt, disc_opt, rank, backward, lonely_read=None) -> list[float]:
    """DCGAN's loop on this rank's half of each batch; `backward(module, loss)`."""
    data = torch.Generator().manual_seed(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    losses = []
    for _ in range(STEPS):
        real = (torch.randn(12, 16, generator=data) + 2).chunk(2)[rank]
        noise = torch.randn(12, 8, generator=data).chunk(2)[rank]
        if lonely_read is not None and rank == 0:
            lonely_read(real)
        fake = gen(noise)
        disc_opt.zero_grad()
        d_loss = bce(disc(real), torch.ones(6, 1)) + bce(disc(fake.detach()), torch.zeros(6, 1))
        backward(disc, d_loss)
        disc_opt.step()
        gen_opt.zero_grad()
        g_loss = bce(disc(fake), torch.ones(6, 1))
        backward(gen, g_loss)
        gen_opt.step()
        losses += [d_loss.item(), g_loss.item()]
    return losses


def distillation_loop(teach, stud, opt, rank, backward) -> list[float]:
    data = torch.Generator().manual_seed(2)
    losses = []
    teach.eval()
    for _ in range(STEPS):
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


def main() -> None:
    out, what = sys.argv[1], sys.argv[2]
    transport = sys.argv[3] if len(sys.argv) > 3 else "auto"
    rank = int(os.environ["RANK"])
    warnings.simplefilter("ignore")
    result = {}
    try:
        dist.init_process_group("gloo")
        reference_backward = lambda module, loss: loss.backward()  # noqa: E731
        engine_backward = lambda module, loss: module.backward(loss)  # noqa: E731
        first, second = (teacher, student) if what == "teacher" else (generator, discriminator)
        torch.manual_seed(0)
        ref_first, ref_second = DDP(first()), DDP(second())
        if what == "teacher":
            result["ddp_losses"] = distillation_loop(
                ref_first, ref_second, adamw(ref_second), rank, reference_backward)
        else:
            result["ddp_losses"] = gan_loop(ref_first, ref_second, adamw(ref_first),
                                            adamw(ref_second), rank, reference_backward)
        result["ddp_states"] = [ref_first.module.state_dict(), ref_second.module.state_dict()]
        torch.manual_seed(0)
        one, one_opt = patrickstar.initialize(first, config=config(transport))
        two, two_opt = patrickstar.initialize(second, config=config(transport))
        if what == "teacher":
            result["losses"] = distillation_loop(one, two, two_opt, rank, engine_backward)
        else:
            reads = []

            def lonely_read(real):
                # Logging, a save and an evaluation of one engine on rank 0 alone while rank
                # 1's next call is the other engine's forward.
                reads.append(two.module[0].weight.norm().item())
                reads.append(two.state_dict()["2.bias"].clone())
                with torch.no_grad():
                    reads.append(two(real).mean().item())
            result["losses"] = gan_loop(one, two, one_opt, two_opt, rank, engine_backward,
                                        lonely_read if what == "gan_read" else None)
            result["reads"] = reads
        result["states"] = [one.state_dict(), two.state_dict()]
    except BaseException as error:  # noqa: BLE001 (reported to the test)
        result.update(error_result(error))
    save_and_exit(out, rank, result)


if __name__ == "__main__":
    main()
