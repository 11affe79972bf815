"""Canonical training scripts as a user ports them, each against the unported script (plain
torch, same seeds): PyTorch examples' word_language_model, karpathy's minGPT Trainer and a
Hugging Face `run_clm_no_trainer.py`-style accelerate loop. Each keeps the original's code but
for what the port needs: the model is built in model_func and the optimizer comes from
initialize()."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patrickstar

# --- word_language_model (pytorch/examples, model.py and main.py) ------------------------------


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ["LSTM", "GRU"]:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())  # Note [New tensors like a parameter]
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def word_language_model(kind, ported, backward, save_path, tied=True):
    """main.py's train()/evaluate()/save/load, tiny; the port anneals Adam's lr by its
    param_groups where the original updates p.data by hand with `lr`."""
    ntokens, bptt, bsz, clip = 40, 6, 4, 0.25
    generator = torch.Generator().manual_seed(1)
    train_data = torch.randint(0, ntokens, (96,), generator=generator).view(bsz, -1).t()
    val_data = torch.randint(0, ntokens, (40,), generator=generator).view(2, -1).t()

    def model_func():
        return RNNModel(kind, ntokens, 16, 16, 2, 0.2, tied)

    torch.manual_seed(0)
    if ported:
        model, optimizer = patrickstar.initialize(model_func, config={
            "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "weight_decay": 0.0}},
            "default_chunk_size": 8192})
    else:
        model = model_func()
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    criterion = nn.NLLLoss()

    def get_batch(source, i):
        seq_len = min(bptt, len(source) - 1 - i)
        return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)

    def evaluate(model, data_source):
        model.eval()
        total_loss = 0.
        hidden = model.init_hidden(2)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, bptt):
                data, targets = get_batch(data_source, i)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    losses, lr, best_val_loss = [], 5e-3, None
    for epoch in range(2):
        model.train()
        hidden = model.init_hidden(bsz)
        for i in range(0, train_data.size(0) - 1, bptt):
            data, targets = get_batch(train_data, i)
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            model.backward(loss) if backward == "model" else loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            losses.append(loss.item())
        val_loss = evaluate(model, val_data)
        losses.append(val_loss)
        if not best_val_loss or val_loss < best_val_loss:
            with open(save_path, "wb") as f:
                torch.save(model.module if ported else model, f)
            best_val_loss = val_loss
        if epoch == 0 or val_loss >= best_val_loss:  # a plateau, forced once
            lr /= 4.0
            for group in optimizer.param_groups:
                group["lr"] = lr
    with open(save_path, "rb") as f:
        model = torch.load(f, weights_only=False)
        model.rnn.flatten_parameters()
    losses.append(evaluate(model, val_data))
    return losses, model


@pytest.mark.parametrize("kind,backward", [("LSTM", "model"), ("GRU", "loss"),
                                           ("RNN_TANH", "loss")])
def test_word_language_model_trains_saves_and_reloads_as_the_plain_script(tmp_path, kind,
                                                                          backward):
    """`torch.save(model.module, f)` of an RNN failed with "cannot pickle
    'weakref.ReferenceType' object" (Note [Copies of the user's module]), and init_hidden's
    `weight.new_zeros` read the whole embedding out of its chunks and warned of a loss term
    that would train nothing (Note [New tensors like a parameter])."""
    expected, reference = word_language_model(kind, False, "loss", tmp_path / "plain.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got, loaded = word_language_model(kind, True, backward, tmp_path / "ported.pt")
    assert type(loaded) is RNNModel and type(loaded.encoder.weight) is nn.Parameter
    assert got == pytest.approx(expected, rel=1e-5)
    assert loaded.decoder.weight is loaded.encoder.weight  # still tied
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_torch_save_of_the_engine_names_what_to_save(tmp_path):
    model, _ = patrickstar.initialize(lambda: RNNModel("GRU", 20, 8, 8, 1, dropout=0.0), config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    with pytest.raises(TypeError, match=r"torch\.save\(model\.module\)"):
        with open(tmp_path / "model.pt", "wb") as f:
            torch.save(model, f)


def test_new_tensors_like_a_parameter_read_no_value(monkeypatch):
    from patrickstar import resting_params
    monkeypatch.setattr(resting_params, "_warned_no_gradient", False)  # said once per process
    model, _ = patrickstar.initialize(lambda: nn.Linear(3, 5), config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    weight = next(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert weight.new_zeros(2, 3).shape == (2, 3)
        assert weight.new_full((2,), 3.0).tolist() == [3.0, 3.0]
        assert torch.zeros_like(weight).shape == (5, 3)
        assert torch.randn_like(weight).dtype == torch.float32
