"""A training script written the way upstream PatrickStar's README, GUIDE and examples write
one (imports, config keys, calls). test_upstream_compat.py runs it unchanged; it must not be
edited to suit PatrickStar-C++."""
import logging
import sys

import torch

from patrickstar.runtime import initialize_engine
from patrickstar.utils import get_world_size, logger, see_memory_usage
from patrickstar.utils.logging import log_dist
from patrickstar.utils.model_size_calculator import get_ps_model_size

hidden_dim = 16
lr, betas, eps, weight_decay = 5e-3, (0.9, 0.999), 1e-6, 0


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.embed = torch.nn.Embedding(32, hidden_dim)
        self.linear1 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.head = torch.nn.Linear(hidden_dim, 32, bias=False)
        self.head.weight = self.embed.weight  # shared parameter, as upstream's is_share_param
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = torch.relu(self.linear1(x))
        x = self.linear2(x)
        return self.loss(self.head(x).float().view(-1, 32), labels.view(-1))


def model_func():
    return SimpleModel(hidden_dim=hidden_dim)


logger.setLevel(logging.WARNING)
config = {
    "optimizer": {
        "type": "Adam",
        "params": {"LR": lr, "BETAS": betas, "EPS": eps, "WEIGHT_DECAY": weight_decay,
                   "use_hybrid_adam": True},
    },
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 2**3,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "default_chunk_size": 1024,
    "release_after_init": False,
    "use_fake_dist": False,
    "use_cpu_embedding": False,
    "client": {
        "mem_tracer": {"use_async_mem_monitor": True, "warmup_gpu_chunk_mem_ratio": 0.1,
                       "overall_gpu_mem_ratio": 0.9, "overall_cpu_mem_ratio": 0.9,
                       "margin_use_ratio": 0.8, "use_fake_dist": False,
                       "with_static_partition": False},
        "opts": {"with_mem_saving_comm": False, "with_mem_cache": False,
                 "with_async_move": False},
    },
}

torch.manual_seed(0)
model, optimizer = initialize_engine(model_func=model_func, local_rank=0, config=config)
model_numel, model_num_param = get_ps_model_size(model)
log_dist(f"Model size {model_numel / 1e9} B, total params: {model_num_param}")
see_memory_usage("After model init", force=True)

generator = torch.Generator().manual_seed(1)
data = [(torch.randint(0, 32, (8, 4), generator=generator),
         torch.randint(0, 32, (8, 4), generator=generator)) for _ in range(4)]
losses = []
for epoch in range(5):
    for input_ids, labels in data:
        optimizer.zero_grad()
        loss = model(input_ids, labels)
        model.backward(loss)
        optimizer.step()
        losses.append(loss.item())
print("loss_scale", optimizer.loss_scaler.loss_scale)
print("world_size", get_world_size())
print("model_size", model_numel, model_num_param)

# GUIDE "Save and Load": torch.save of the state dicts, loaded back into the engine.
out = sys.argv[1]
torch.save(model.state_dict(), f"{out}/model.pt")
torch.save(optimizer.state_dict(), f"{out}/optimizer.pt")
model.load_state_dict(torch.load(f"{out}/model.pt"))
optimizer.load_state_dict(torch.load(f"{out}/optimizer.pt"))

model.eval()
with torch.no_grad():
    eval_loss = model(*data[0]).item()
print("losses", " ".join(f"{value:.6f}" for value in losses))
print("eval_loss", eval_loss)
