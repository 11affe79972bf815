"""DeepSpeed's batch-size keys: `train_batch_size`, `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps`, resolved against the data-parallel world size.

Note [DeepSpeed's batch keys set the accumulation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A DeepSpeed config rarely names `gradient_accumulation_steps`: it gives `train_batch_size` and
`train_micro_batch_size_per_gpu`, and DeepSpeed derives the accumulation as
train_batch_size / (micro batch * data-parallel ranks). These keys were refused here with
"remove it", and removing them silently turned, say, 4 accumulated micro-batches per step into
1 (four times the steps at a quarter of the batch). They are now resolved as DeepSpeed's
`_set_batch_related_parameters` does:

  all three        must satisfy train = micro * accumulation * ranks
  train, micro     accumulation = train // micro // ranks
  train, accum.    micro = train // ranks // accumulation
  micro, accum.    train = micro * accumulation * ranks
  train only       accumulation 1, micro = train // ranks
  micro only       accumulation 1, train = micro * ranks
  accum. only      (not DeepSpeed's: it needs a batch size) the batch sizes stay unknown

and anything that does not divide evenly is refused naming the three numbers. The batch size
itself is still the data loader's: like DeepSpeed's engine (outside its own `deepspeed_io`
loader), ours does not check the tensors it is given. The data-parallel size is the ranks
holding copies of the same stage and slice (pipeline and tensor ranks are not data ranks).
"""
from __future__ import annotations

import dataclasses


def resolve_batch_sizes(config, data_ranks: int):
    """`config` with all three batch keys set consistently (unchanged when no batch size was
    given); raises ValueError naming the keys when they cannot agree."""
    train = config.train_batch_size
    micro = config.train_micro_batch_size_per_gpu
    accumulation = config.gradient_accumulation_steps if config.accumulation_given else None
    if train is None and micro is None:
        return config
    if train is not None and micro is not None and accumulation is None:
        accumulation = train // micro // data_ranks
    elif train is not None and micro is None:
        accumulation = accumulation or 1
        micro = train // data_ranks // accumulation
    elif train is None:
        accumulation = accumulation or 1
        train = micro * accumulation * data_ranks
    if accumulation < 1 or micro < 1 or train != micro * accumulation * data_ranks:
        raise ValueError(
            f"config keys 'train_batch_size' ({config.train_batch_size}), "
            f"'train_micro_batch_size_per_gpu' ({config.train_micro_batch_size_per_gpu}) and "
            f"'gradient_accumulation_steps' "
            f"({config.gradient_accumulation_steps if config.accumulation_given else 'not set'})"
            f" do not agree with {data_ranks} data-parallel rank(s): train_batch_size must equal "
            f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * ranks, as in "
            f"DeepSpeed")
    return dataclasses.replace(config, train_batch_size=train,
                               train_micro_batch_size_per_gpu=micro,
                               gradient_accumulation_steps=accumulation, accumulation_given=True)
