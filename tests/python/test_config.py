"""Config parsing and validation: every bad value names its key path."""
import json
import warnings

import pytest

from patrickstar.config import load_config, parse_bytes
from patrickstar.loss_scaler import (DynamicLossScaler, LossScaleAtMinimum, StaticLossScaler,
                                     make_loss_scaler)


def test_defaults():
    config = load_config(None)
    assert config.precision == "fp32"
    assert config.optimizer.type == "Adam" and config.optimizer.lr == 1e-3
    assert config.gradient_accumulation_steps == 1
    assert config.memory.device_budget is None and config.memory.nvme.path is None


def test_patrickstar_example_config_parses(tmp_path):
    patrickstar_config = {
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": (0.9, 0.999),
                                                 "eps": 1e-6, "weight_decay": 0,
                                                 "use_hybrid_adam": True}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 2 ** 3,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "default_chunk_size": 64 * 1024 * 1024,
        "release_after_init": True,
        "use_cpu_embedding": False,
        "client": {"mem_tracer": {"use_async_mem_monitor": True,
                                  "warmup_gpu_chunk_mem_ratio": 0.1,
                                  "overall_gpu_mem_ratio": 0.8, "overall_cpu_mem_ratio": 0.8,
                                  "margin_use_ratio": 0.8, "use_fake_dist": False},
                   "opts": {"with_mem_cache": True, "with_async_move": True}},
    }
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(patrickstar_config))
    with pytest.warns(UserWarning, match="client.mem_tracer.use_async_mem_monitor") as record:
        config = load_config(str(path))
    assert len(record) == 1  # reported once, in one warning
    assert "release_after_init" in str(record[0].message)
    assert config.precision == "fp16"
    assert config.fp16.initial_scale_power == 8
    assert config.optimizer.eps == 1e-6
    assert config.default_chunk_size == 64 * 1024 * 1024


def test_new_keys_parse():
    config = load_config({
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "memory": {"device_budget": "2GiB", "host_budget": 3 * 2**30,
                   "nvme": {"path": "/tmp", "budget": "10GB", "queue_depth": 8,
                            "block_size": "1MiB"}},
        "profile": {"enabled": True, "output_dir": "prof"},
        "parallel": {"data": 2, "pipeline": 1, "tensor": 1},
        "default_chunk_size": "auto",
    })
    assert config.precision == "bf16"
    assert config.optimizer.type == "AdamW" and config.optimizer.decoupled_weight_decay
    assert config.memory.device_budget == 2 * 2**30
    assert config.memory.nvme.budget == 10 * 10**9
    assert config.memory.nvme.block_size == 2**20
    assert config.memory.nvme.verify  # Note [NVMe checksums]: on unless turned off
    assert config.default_chunk_size is None
    assert config.parallel.data == 2


@pytest.mark.parametrize("config, key", [
    ({"optimiser": {}}, "'optimiser'"),
    ({"optimizer": {"params": {"lr": -1}}}, "'optimizer.params.lr': must be >= 0"),
    ({"optimizer": {"params": {"lr": "fast"}}}, "'optimizer.params.lr': expected a number"),
    ({"optimizer": {"params": {"betas": [0.9]}}}, "'optimizer.params.betas'"),
    ({"optimizer": {"params": {"betas": [0.9, 1.0]}}}, "'optimizer.params.betas[1]': must be < 1"),
    # (1.5 was "must be <= 1.0", though 1.0 itself is refused: torch's rule is 0 <= beta < 1)
    ({"optimizer": {"params": {"betas": [1.5, 0.9]}}},
     "'optimizer.params.betas[0]': must be < 1, got 1.5"),
    ({"optimizer": {"params": {"eps": -1e-8}}}, "'optimizer.params.eps': must be >= 0"),
    ({"optimizer": {"params": {"amsgrad": True}}}, "'optimizer.params.amsgrad'"),
    ({"optimizer": {"params": {"momentum": 0.9}}}, "'optimizer.params.momentum'"),
    ({"optimizer": {"type": "SGD"}}, "'optimizer.type'"),
    ({"default_chunk_size": 0}, "'default_chunk_size': must be >= 1"),
    ({"default_chunk_size": 1.5}, "'default_chunk_size': expected an integer"),
    ({"default_chunk_size": "auto "},
     "'default_chunk_size': expected a number of elements or \"auto\", got 'auto '"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "only one of them"),
    ({"fp16": {"enabled": "yes"}}, "'fp16.enabled': expected true or false"),
    ({"fp16": {"hysteresis": 0}}, "'fp16.hysteresis'"),
    ({"fp16": {"min_loss_scale": 0}}, "'fp16.min_loss_scale'"),
    ({"fp16": {"loss_scale": -2}}, "'fp16.loss_scale'"),
    ({"gradient_accumulation_steps": 0}, "'gradient_accumulation_steps'"),
    ({"gradient_clipping": -1.0}, "'gradient_clipping'"),
    ({"memory": {"device_budget": "two gigs"}}, "'memory.device_budget'"),
    ({"memory": {"device_budget": -5}}, "'memory.device_budget'"),
    ({"memory": {"host_budget": 0}}, "'memory.host_budget': must be > 0"),
    ({"memory": {"nvme": {"budget": "1GiB"}}}, "'memory.nvme.path': required"),
    ({"memory": {"nvme": {"path": "/tmp", "block_size": 1000}}}, "'memory.nvme.block_size'"),
    ({"memory": {"nvme": {"path": "/tmp", "queue_depth": 0}}}, "'memory.nvme.queue_depth'"),
    ({"memory": {"nvme": {"path": "/tmp", "verify": "yes"}}}, "'memory.nvme.verify'"),
    ({"memory": {"gpu": 1}}, "'memory.gpu'"),
    ({"parallel": {"tensor": 0}}, "'parallel.tensor'"),
    ({"client": {"mem_tracer": {"bogus": 1}}}, "'client.mem_tracer.bogus'"),
    ({"profile": []}, "'profile': expected an object"),
    ([1, 2], "'<config>': expected an object"),
])
def test_bad_configs_name_the_key(config, key):
    with pytest.raises(ValueError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(config)
    assert key in str(info.value)


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    # It was Python's bare "[Errno 21] Is a directory: '...'".
    with pytest.raises(IsADirectoryError, match=f"config file '{tmp_path}' is a directory"):
        load_config(str(tmp_path))


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_config(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        load_config(str(broken))


@pytest.mark.parametrize("text, expected", [
    ("512", 512), ("4KiB", 4096), ("2GiB", 2 * 2**30), ("1.5 GiB", 3 * 2**29),
    ("10GB", 10**10), ("3mib", 3 * 2**20), (1024, 1024), (2.0**20, 2**20),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_nonsense():
    for bad in ("1 parsec", "", "GiB", True, [1], -1, 1.5):
        with pytest.raises(ValueError, match="budget"):
            parse_bytes(bad, "budget")
    for negative in ("-5GiB", "-0.5", " -1 MB"):  # was "cannot read '-5GiB' as a size"
        with pytest.raises(ValueError, match=f"'budget': must be >= 0 bytes, got '{negative}'"):
            parse_bytes(negative, "budget")


@pytest.mark.parametrize("value", ["1e400GiB", "1e30", 10**30, 2**63, "80%", "20 GiB of RAM",
                                   "0.5", "0.9B"])
def test_budgets_out_of_range_name_the_key_and_value(value):
    """Before: "1e400GiB" raised a bare OverflowError, and a budget above int64 passed the
    config and failed in initialize() as pybind11's "incompatible constructor arguments"; "0.5"
    became 0 bytes, which for the NVMe budget means all free space."""
    for key in ("device_budget", "host_budget"):
        with pytest.raises(ValueError, match=f"memory.{key}") as info:
            load_config({"memory": {key: value}})
        assert repr(value) in str(info.value)
    with pytest.raises(ValueError, match="memory.nvme.budget"):
        load_config({"memory": {"nvme": {"path": "/tmp", "budget": value}}})
    assert parse_bytes(2**63 - 1) == 2**63 - 1


def test_dynamic_loss_scaler_follows_the_rules():
    scaler = DynamicLossScaler(scale=2.0**10, scale_window=3, hysteresis=2, min_scale=256)
    scaler.update(overflow=True)   # spends hysteresis, scale unchanged
    assert scaler.scale == 2.0**10 and scaler.hysteresis_left == 1
    scaler.update(overflow=True)   # no hysteresis left: halve
    assert scaler.scale == 2.0**9
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**8
    with pytest.raises(LossScaleAtMinimum, match=r"fp16.min_loss_scale = 256"):
        scaler.update(overflow=True)   # already at min_scale: DeepSpeed raises here too
    assert scaler.scale == 256 and scaler.overflows == 3
    scaler.raise_error_at_min_scale = False
    scaler.update(overflow=True)   # clamped at min_scale
    assert scaler.scale == 256
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 256
    scaler.update(overflow=False)  # third clean step in a row: double, refill hysteresis
    assert scaler.scale == 512 and scaler.hysteresis_left == 2
    assert scaler.overflows == 4
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    assert restored.raise_error_at_min_scale  # the script's setting is not training state


def test_make_loss_scaler_from_config():
    assert isinstance(make_loss_scaler(load_config({})), StaticLossScaler)
    static = make_loss_scaler(load_config({"fp16": {"enabled": True, "loss_scale": 128}}))
    assert isinstance(static, StaticLossScaler) and static.scale == 128
    dynamic = make_loss_scaler(load_config({"fp16": {"enabled": True, "initial_scale_power": 5,
                                                     "loss_scale_window": 7}}))
    assert isinstance(dynamic, DynamicLossScaler)
    assert dynamic.scale == 32 and dynamic.scale_window == 7


def test_adamw_default_weight_decay_is_torchs():
    # torch.optim.AdamW defaults to 1e-2 (DeepSpeed's own kernels to 0: the README says so,
    # test_deepspeed_port.py).
    assert load_config({"optimizer": {"type": "AdamW"}}).optimizer.weight_decay == 1e-2
    assert load_config({"optimizer": {"type": "Adam"}}).optimizer.weight_decay == 0.0
    assert load_config({"optimizer": {"type": "AdamW",
                                      "params": {"weight_decay": 0}}}).optimizer.weight_decay == 0


def test_deepspeed_documented_fp16_section_is_accepted():
    """DeepSpeed's documented fp16 example carries auto_cast, consecutive_hysteresis and
    fp16_master_weights_and_grads; copied as it is, it configures the same scaler."""
    fp16 = load_config({"fp16": {
        "enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
        "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
        "min_loss_scale": 1, "fp16_master_weights_and_grads": False}}).fp16
    assert fp16.dynamic and not fp16.auto_cast and not fp16.consecutive_hysteresis
    assert load_config({"fp16": {"enabled": True, "auto_cast": True}}).fp16.auto_cast
    scaler = make_loss_scaler(load_config({"fp16": {"enabled": True,
                                                    "consecutive_hysteresis": True}}))
    assert scaler.consecutive_hysteresis
    with pytest.raises(ValueError, match="'fp16.fp16_master_weights_and_grads'.*master_weights"):
        load_config({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})
    with pytest.raises(ValueError, match="'fp16.auto_cast'"):
        load_config({"fp16": {"enabled": True, "auto_cast": "yes"}})


def test_dynamic_loss_scale_starting_below_its_minimum_is_refused():
    with pytest.raises(ValueError, match=r"'fp16.min_loss_scale' \(4\) and "
                                         r"'fp16.initial_scale_power' \(1\)"):
        load_config({"fp16": {"enabled": True, "initial_scale_power": 1, "min_loss_scale": 4}})
    load_config({"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 4}})
    load_config({"fp16": {"enabled": True, "loss_scale": 1, "min_loss_scale": 4}})  # static


def test_duplicate_keys_in_a_json_config_are_refused_naming_them(tmp_path):
    """json.load keeps the last of two equal keys, so a config file with "lr" twice (a merge
    left both) trained with whichever came last without a word; DeepSpeed's loader refuses
    duplicates, and so does ours, naming the key."""
    path = tmp_path / "ds_config.json"
    path.write_text('{"optimizer": {"type": "Adam", "params": {"lr": 0.1, "eps": 1e-8, '
                    '"lr": 0.001}}, "gradient_clipping": 1.0}')
    with pytest.raises(ValueError, match=r"ds_config.json.*duplicate key 'lr'"):
        load_config(str(path))


@pytest.mark.parametrize("where", ["file", "missing"])
def test_an_unusable_nvme_path_names_the_config_key(tmp_path, where):
    """The tier's error named the path only ("nvme tier: '...': Not a directory"), not the
    key it came from."""
    import torch

    import patrickstar
    path = tmp_path / "swap"
    if where == "file":
        path.write_text("x")
    with pytest.raises(OSError) as error:
        patrickstar.initialize(lambda: torch.nn.Linear(2, 2),
                               config={"memory": {"nvme": {"path": str(path)}}})
    assert f"config key 'memory.nvme.path' = '{path}'" in "\n".join(error.value.__notes__)


def test_an_nvme_path_under_a_tilde_says_it_is_not_expanded():
    """A JSON config's "~/nvme" failed with "directory '~/nvme': No such file or directory",
    which reads as if the home directory lacked it."""
    import torch

    import patrickstar
    with pytest.raises(OSError) as error:
        patrickstar.initialize(lambda: torch.nn.Linear(2, 2),
                               config={"memory": {"nvme": {"path": "~/no-such-swap-dir"}}})
    assert "'~' is not expanded: give the full path" in "\n".join(error.value.__notes__)
