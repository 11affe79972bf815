"""Pipeline parallelism above the chunk runtime: layers split into stages, one engine (and chunk
manager) per stage, micro batches passed between stages (docs/parallelism.md).

    model = PipelineModule(layers=[LayerSpec(...), ...], loss_fn=..., partition_method="parameters")
    engine, optimizer = patrickstar.initialize(model, config={"parallel": {"pipeline": 2}, ...})
    loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro batches, one step
"""
from .engine import PipelineEngine
from .module import LayerSpec, PipelineModule, TiedLayerSpec, partition_balanced, \
    partition_uniform
from .p2p import PipelinePeerError
from .schedule import SCHEDULES

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "PipelinePeerError", "SCHEDULES",
           "TiedLayerSpec", "partition_balanced", "partition_uniform"]

