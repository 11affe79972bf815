"""torch DistributedDataParallel's own methods on the engine, for scripts written against a
DDP-wrapped model (the engine takes DDP's place under torchrun: it is data-parallel itself).

Note [DDP's join() for uneven inputs]
DDP's `with model.join():` lets ranks run different numbers of training iterations: a rank whose
inputs ran out shadows the others' gradient all-reduces with zeros (its optimizer does not step;
the model is broadcast from the last rank to join at the end). Here a rank cannot stand aside so
cheaply: it owns a shard of every chunk group and of the optimizer state, so each of the others'
steps needs its gathers, reduce-scatters and its own shard's optimizer update, at the others'
learning rate, clipping and loss scale, none of which it can see. So uneven inputs are not
shadowed; the ranks raise instead, at once and on every rank, as DDP's join does with
`throw_on_early_termination=True`: leaving the block is a call of its own in the ranks' call
agreement (Note [Every rank runs the same forwards] in data_parallel.py), so a rank whose
inputs ran out meets the others' next training forward there, and both raise naming what each
runs. Even inputs (DistributedSampler's equal shards) train as without the block. The block's
arguments are DDP's and change nothing else (`divide_by_initial_world_size`: gradients are
averaged over the whole data-parallel world either way; `enable=False` also skips the check).

Note [DDP communication hooks]
DDP reduces gradient buckets through a hook (`register_comm_hook`), the average by default
(`default_hooks.allreduce_hook`). Here each chunk group's gradients are reduce-scattered in C++,
in the chunks' dtype, averaged over the data-parallel ranks: DDP's default hook describes exactly
that and is accepted, changing nothing; any other (fp16/bf16 compression, PowerSGD, a hook of
the script's own) would have changed what is reduced, so it raises naming the hook rather than
training without it.

Note [SyncBatchNorm in a forward on one rank]
`nn.SyncBatchNorm.convert_sync_batchnorm(model)` (DDP's companion) makes each BatchNorm of a
module in train mode all-gather the batch statistics over the default group inside its forward:
every rank must run that forward. A forward without backward on one rank alone is otherwise
served by the others (Note [Reads on one rank are served] in data_parallel.py), who do not run
it: the lone rank's all-gathers would meet the others' next training forward's (the statistics
of two different batches mixed, silently) and leave them waiting for the rest, and the lone
rank's next call would wait for the collective timeout. (torch's SyncBatchNorm has no CPU
kernels: there its forward raises at once on any rank, so on the CPU only the agreement's error
can be seen.) So a forward without backward whose module holds a
SyncBatchNorm in train mode is a call kind of its own, never served: on one rank alone it raises
at once on every rank, naming it; on every rank it runs as any forward. In eval mode the layers
use their running statistics, make no collective, and the forward is served as usual."""
from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["join", "register_comm_hook", "sync_batch_norms"]


def sync_batch_norms(module: nn.Module) -> list[nn.SyncBatchNorm]:
    """The SyncBatchNorm layers of `module` (Note [SyncBatchNorm in a forward on one rank])."""
    return [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]


@contextlib.contextmanager
def join(data_parallel, enable: bool = True):
    """DDP's `model.join()` (Note [DDP's join() for uneven inputs])."""
    yield
    if enable:
        data_parallel.agree_on_training_call(data_parallel.JOIN_END)


def _is_default_allreduce(hook) -> bool:
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError:  # torch built without distributed: no hook is DDP's
        return False
    return hook is default_hooks.allreduce_hook


def register_comm_hook(state, hook) -> None:
    """DDP's `model.register_comm_hook(state, hook)` (Note [DDP communication hooks])."""
    if _is_default_allreduce(hook):
        return
    name = getattr(hook, "__qualname__", None) or repr(hook)
    raise NotImplementedError(
        f"register_comm_hook(state, {name}): the engine reduce-scatters each chunk group's "
        f"gradients itself (in C++, in the training dtype, averaged over the data-parallel "
        f"ranks), so a DDP communication hook cannot run on them; only DDP's default, "
        f"default_hooks.allreduce_hook (the same average), is accepted. For 16-bit gradient "
        f"communication (fp16_compress_hook, bf16_compress_hook) train in 16 bits: config "
        f"section \"fp16\" or \"bf16\"; drop other hooks (PowerSGD) from the script")
