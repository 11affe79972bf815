"""Classic PyTorch training recipes run on the engine as a user brings them, each against the
same model trained by plain PyTorch (torch.optim.Adam/AdamW, same seeds and data)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar


def initialize_alongside(model_func, optimizer: str = "AdamW", lr: float = 1e-2,
                         weight_decay: float = 0.1):
    """The engine and the plain model with torch's optimizer, built from the same seed."""
    torch.manual_seed(0)
    reference = model_func()
    ref_optimizer = getattr(torch.optim, optimizer)(reference.parameters(), lr=lr,
                                                    weight_decay=weight_decay)
    torch.manual_seed(0)
    model, ours = patrickstar.initialize(model_func, config={
        "optimizer": {"type": optimizer, "params": {"lr": lr, "weight_decay": weight_decay,
                                                    "adam_w_mode": optimizer == "AdamW"}},
        "default_chunk_size": 4096})
    return model, ours, reference, ref_optimizer


def assert_same_weights(model, reference) -> None:
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, msg=key)


class Branching(nn.Module):
    """A branch taken only in some steps: its parameters get no gradient in the others."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, take_branch: bool):
        h = torch.relu(self.body(x))
        if take_branch:
            h = h + self.branch(h)
        return self.head(h)


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
@pytest.mark.parametrize("zero_grad", ["optimizer_first", "optimizer", "model", "model.module",
                                       "part", "set_to_none_later"])
def test_zero_grad_keeping_zeros_updates_unused_parameters_as_pytorch(zero_grad, optimizer):
    # zero_grad(set_to_none=False) (torch's default before 2.0) leaves p.grad zeros, so
    # torch's Adam moves a parameter unused in a step by its first moment (and AdamW's
    # decay): the engine skipped it (Note [Gradients zeroed, not dropped] in optimizer.py).
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))
    model, ours, reference, ref_optimizer = initialize_alongside(Branching, optimizer)

    def zero(engine, opt, module, step):
        set_to_none = zero_grad == "set_to_none_later" and step >= 3
        if zero_grad in ("optimizer_first", "optimizer", "set_to_none_later"):
            opt.zero_grad(set_to_none=set_to_none)
        elif zero_grad == "model":
            engine.zero_grad(set_to_none=False)
        elif zero_grad == "model.module":
            module.zero_grad(set_to_none=False)
        else:  # the branch keeps zeros, the rest is dropped
            module.branch.zero_grad(set_to_none=False)
            module.body.zero_grad()
            module.head.zero_grad()

    pairs = ((model, ours, model.module), (reference, ref_optimizer, reference))
    for step in range(6):
        for engine, opt, module in pairs:
            if zero_grad == "optimizer_first":
                zero(engine, opt, module, step)
            (engine(x, step in (0, 4)) - y).pow(2).mean().backward()
        # The engine's view of p.grad agrees: zeros where torch keeps them, else None.
        kept, expected = (patrickstar.safe_get_full_grad(model.module.branch.weight),
                          reference.branch.weight.grad)
        assert (kept is None) == (expected is None)
        if expected is not None:
            torch.testing.assert_close(kept, expected)
        for engine, opt, module in pairs:
            opt.step()
            if zero_grad != "optimizer_first":
                zero(engine, opt, module, step)
    assert_same_weights(model, reference)


def classify_alongside(model, optimizer, reference, ref_optimizer, batches, loss_of):
    """Trains both on `batches` (`loss_of(module, batch)`), the engine with loss.backward() as
    a PyTorch loop calls it; the losses step by step."""
    losses, ref_losses = [], []
    for batch, ref_batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = loss_of(reference, ref_batch)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    return losses, ref_losses


@pytest.mark.parametrize("workers", [
    {"num_workers": 2},
    {"num_workers": 2, "persistent_workers": True, "pin_memory": True},
    {"num_workers": 2, "multiprocessing_context": "spawn"}])
def test_data_loader_workers_started_after_initialize_feed_the_engine(workers):
    # Workers forked (or spawned) while the engine's runtime and threads exist.
    from torch.utils.data import DataLoader, TensorDataset

    def mlp():
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))

    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=generator),
                         torch.randint(0, 2, (48,), generator=generator))
    model, optimizer, reference, ref_optimizer = initialize_alongside(mlp)
    batches = []
    for epoch in range(2):
        loaders = [DataLoader(data, batch_size=16, shuffle=True,
                              generator=torch.Generator().manual_seed(epoch), **options)
                   for options in (workers, {})]
        batches += list(zip(*loaders))
    losses, ref_losses = classify_alongside(
        model, optimizer, reference, ref_optimizer, batches,
        lambda module, batch: nn.functional.cross_entropy(module(batch[0]), batch[1]))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_weights(model, reference)


class PackedLanguageModel(nn.Module):
    """Padded batches packed for a bidirectional, two-layer LSTM or GRU (flat weights), with a
    padding_idx embedding; the loss ignores the padding."""

    def __init__(self, kind: str):
        super().__init__()
        self.embedding = nn.Embedding(40, 12, padding_idx=0)
        self.rnn = getattr(nn, kind)(12, 16, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(32, 40)

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(tokens), lengths,
                                                   batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                  total_length=tokens.shape[1])
        return self.head(out)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_packed_sequences_through_bidirectional_recurrent_layers_train_as_pytorch(kind):
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([7, 3, 5, 2])
    tokens = torch.randint(1, 40, (4, 7), generator=generator)
    targets = torch.randint(1, 40, (4, 7), generator=generator)
    for row, length in enumerate(lengths):
        tokens[row, length:] = 0
        targets[row, length:] = -100
    model, optimizer, reference, ref_optimizer = initialize_alongside(
        lambda: PackedLanguageModel(kind), "Adam", lr=1e-3, weight_decay=0.0)

    def loss_of(module, _):
        return nn.functional.cross_entropy(module(tokens, lengths).flatten(0, 1),
                                           targets.flatten())

    losses, ref_losses = classify_alongside(model, optimizer, reference, ref_optimizer,
                                            [(None, None)] * 4, loss_of)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_weights(model, reference)
    model.eval()
    reference.eval()
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens, lengths), reference(tokens, lengths))


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder (batch_first, nested tensors) with src_key_padding_mask, then
    nn.MultiheadAttention called directly with the same mask; a dict out."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(40, 32, padding_idx=0)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True), 2)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, tokens):
        padding = tokens == 0
        h = self.encoder(self.embedding(tokens), src_key_padding_mask=padding)
        mixed, weights = self.attention(h, h, h, key_padding_mask=padding)
        h = (h + mixed).masked_fill(padding[..., None], 0).sum(1) / (~padding).sum(1,
                                                                                keepdim=True)
        return {"logits": self.head(h), "weights": weights}


def test_padded_transformer_encoder_trains_and_takes_the_eval_fast_path_as_pytorch():
    tokens = torch.randint(1, 40, (4, 9), generator=torch.Generator().manual_seed(3))
    tokens[0, 5:] = 0
    tokens[2, 3:] = 0
    labels = torch.tensor([0, 1, 2, 1])
    model, optimizer, reference, ref_optimizer = initialize_alongside(PaddedEncoder, lr=1e-3)

    def loss_of(module, seed):
        torch.manual_seed(seed)  # the same dropout masks
        return nn.functional.cross_entropy(module(tokens)["logits"], labels)

    losses, ref_losses = classify_alongside(model, optimizer, reference, ref_optimizer,
                                            [(seed, seed) for seed in range(3)], loss_of)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    model.eval()
    reference.eval()
    for evaluation in (torch.no_grad, torch.inference_mode):  # nested-tensor fast path
        with evaluation():
            torch.testing.assert_close(model(tokens)["logits"], reference(tokens)["logits"])


def schedulers():
    from torch.optim import lr_scheduler as schedules
    return {
        "plateau": lambda o: schedules.ReduceLROnPlateau(o, patience=0, factor=0.3,
                                                         threshold=10.0),
        "warmup_then_cosine": lambda o: schedules.SequentialLR(o, [
            schedules.LinearLR(o, 0.1, 1.0, total_iters=2), schedules.CosineAnnealingLR(o, 4)],
            milestones=[2]),
        "lambda_warmup": lambda o: schedules.LambdaLR(o, lambda step: min(1.0, (step + 1) / 3)),
        "one_cycle": lambda o: schedules.OneCycleLR(o, max_lr=1e-2, total_steps=20),
        "chained": lambda o: schedules.ChainedScheduler([
            schedules.ConstantLR(o, factor=0.5, total_iters=2), schedules.ExponentialLR(o, 0.9)]),
        # cycles Adam's beta1 as well (cycle_momentum)
        "cyclic": lambda o: schedules.CyclicLR(o, 1e-4, 1e-2, step_size_up=2),
    }


@pytest.mark.parametrize("name", list(schedulers()))
def test_lr_schedulers_and_their_resume_follow_pytorch(name):
    # The scheduler's and the optimizer's state_dict saved after 3 steps and loaded into a new
    # engine (and a new torch model) in PyTorch's order: optimizer, then a new scheduler.
    import io
    make = schedulers()[name]
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randn(16, 2, generator=torch.Generator().manual_seed(1))

    def mlp():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def steps(module, optimizer, scheduler, count):
        record = []  # each step's loss and lr
        for _ in range(count):
            loss = (module(x) - y).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step(loss.item()) if name == "plateau" else scheduler.step()
            record += [loss.item(), optimizer.param_groups[0]["lr"]]
        return record

    def resumed(module, optimizer, scheduler, new_module, new_optimizer):
        saved = io.BytesIO()
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, saved)
        saved.seek(0)
        state = torch.load(saved, weights_only=False)
        new_module.load_state_dict(state["model"])
        new_optimizer.load_state_dict(state["optimizer"])
        new_scheduler = make(new_optimizer)
        new_scheduler.load_state_dict(state["scheduler"])
        return new_scheduler

    model, optimizer, reference, ref_optimizer = initialize_alongside(mlp, lr=1e-3)
    scheduler, ref_scheduler = make(optimizer), make(ref_optimizer)
    assert steps(model, optimizer, scheduler, 3) == pytest.approx(
        steps(reference, ref_optimizer, ref_scheduler, 3), rel=1e-6)
    new_model, new_optimizer, new_reference, new_ref_optimizer = initialize_alongside(
        mlp, lr=1e-3)
    scheduler = resumed(model, optimizer, scheduler, new_model, new_optimizer)
    ref_scheduler = resumed(reference, ref_optimizer, ref_scheduler, new_reference,
                            new_ref_optimizer)
    assert steps(new_model, new_optimizer, scheduler, 3) == pytest.approx(
        steps(new_reference, new_ref_optimizer, ref_scheduler, 3), rel=1e-6)
    assert_same_weights(new_model, new_reference)


class TinyLM(nn.Module):
    """nanoGPT's shape in miniature: embedding, a block, a head, the loss inside forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(),
                                   nn.Linear(64, 16))
        self.head = nn.Linear(16, 50)

    def forward(self, idx, targets):
        h = self.embed(idx)
        h = h + self.block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def token_batches(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50, (4, 8), generator=generator),
             torch.randint(0, 50, (4, 8), generator=generator)) for _ in range(count)]


@pytest.mark.parametrize("call", ["loss.backward", "model.backward"])
def test_pytorch_accumulation_loop_without_the_config_key_matches_pytorch(call):
    # nanoGPT's train.py: several backward() calls per step, each loss divided by their number,
    # no gradient_accumulation_steps in the config (Note [PyTorch's accumulation without the
    # key] in guards.py). It raised "called 2 times since the last optimizer.step()" before.
    model, ours, reference, ref_optimizer = initialize_alongside(TinyLM)
    micro_steps = 3
    data = token_batches(3 * micro_steps)
    for step in range(3):
        for x, y in data[step * micro_steps:(step + 1) * micro_steps]:
            loss = model(x, y) / micro_steps
            loss.backward() if call == "loss.backward" else model.backward(loss)
            (reference(x, y) / micro_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ours.step(), ref_optimizer.step()
        ours.zero_grad(set_to_none=True), ref_optimizer.zero_grad(set_to_none=True)
    assert_same_weights(model, reference)


def test_pytorch_accumulation_in_bf16_warns_once_naming_the_key():
    torch.manual_seed(0)
    model, ours = patrickstar.initialize(TinyLM, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 4096,
        "bf16": {"enabled": True}})
    data = token_batches(6)
    with pytest.warns(UserWarning, match="gradient_accumulation_steps") as record:
        for step in range(2):
            for x, y in data[3 * step:3 * step + 3]:
                (model(x, y) / 3).backward()
            ours.step(), ours.zero_grad()
    assert sum("summed in the compute dtype" in str(w.message) for w in record) == 1


def test_more_backward_calls_than_a_given_key_still_raise():
    # The key given is DeepSpeed's contract (that many backward calls, then a step).
    torch.manual_seed(0)
    model, ours = patrickstar.initialize(TinyLM, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 4096,
        "gradient_accumulation_steps": 1})
    (x, y), (x2, y2) = token_batches(2)
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps is 1"):
        model(x2, y2).backward()
