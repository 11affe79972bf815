"""A checkpoint writer that test_checkpoint.py kills with SIGKILL.

    checkpoint_writer.py DIR two    save tag "first", then "second" (the test sets
                                    PATRICKSTAR_CHECKPOINT_CRASH_AT to die inside the second)
    checkpoint_writer.py DIR loop   save "step-0", print "ready", then save "step-1",
                                    "step-2", ... until killed; layers.0.weight of "step-k" is
                                    filled with k so the test can tell a torn checkpoint
"""
import os
import sys
import warnings

import torch

import patrickstar
from test_checkpoint import DropoutMLP, base_config, batches, train


def main(save_dir: str, mode: str) -> None:
    crash_at = os.environ.pop("PATRICKSTAR_CHECKPOINT_CRASH_AT", None)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(DropoutMLP, config=base_config("fp32"))
    train(model, opt, batches(1))
    if mode == "two":
        model.save_checkpoint(save_dir, tag="first", client_state={"tag": "first"})
        if crash_at:
            os.environ["PATRICKSTAR_CHECKPOINT_CRASH_AT"] = crash_at
        model.save_checkpoint(save_dir, tag="second", client_state={"tag": "second"})
        return
    state = model.state_dict()
    for step in range(10**6):
        state["layers.0.weight"].fill_(float(step))
        model.load_state_dict(state)
        tag = f"step-{step}"
        model.save_checkpoint(save_dir, tag=tag, client_state={"tag": tag})
        if step == 0:
            print("ready", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
