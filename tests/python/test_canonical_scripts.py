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


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x):
        return self.dropout(x + self.pe[:x.size(0), :])


class TransformerModel(nn.Transformer):
    """model.py's: an nn.Transformer whose decoder stack is replaced by a Linear."""

    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.5):
        super().__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid,
                         num_encoder_layers=nlayers)
        self.model_type = "Transformer"
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, has_mask=True):
        if has_mask:
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                self.src_mask = torch.log(torch.tril(torch.ones(len(src), len(src)))).to(
                    src.device)
        else:
            self.src_mask = None
        src = self.pos_encoder(self.input_emb(src) * math.sqrt(self.ninp))
        return F.log_softmax(self.decoder(self.encoder(src, mask=self.src_mask)), dim=-1)


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

    def model_func():  # main.py's .to(device)
        if kind == "Transformer":
            return TransformerModel(ntokens, 16, 2, 16, 2, 0.2).to("cpu")
        return RNNModel(kind, ntokens, 16, 16, 2, 0.2, tied).to("cpu")

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
        if kind != "Transformer":
            hidden = model.init_hidden(2)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, bptt):
                data, targets = get_batch(data_source, i)
                if kind == "Transformer":
                    output = model(data).view(-1, ntokens)
                else:
                    output, hidden = model(data, hidden)
                    hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    losses, lr, best_val_loss = [], 5e-3, None
    for epoch in range(2):
        model.train()
        if kind != "Transformer":
            hidden = model.init_hidden(bsz)
        for i in range(0, train_data.size(0) - 1, bptt):
            data, targets = get_batch(train_data, i)
            model.zero_grad()
            if kind == "Transformer":
                output = model(data).view(-1, ntokens)
            else:
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
        if kind != "Transformer":
            model.rnn.flatten_parameters()
    losses.append(evaluate(model, val_data))
    return losses, model


@pytest.mark.parametrize("kind,backward", [("LSTM", "model"), ("GRU", "loss"),
                                           ("RNN_TANH", "loss"), ("Transformer", "loss")])
def test_word_language_model_trains_saves_and_reloads_as_the_plain_script(tmp_path, kind,
                                                                          backward):
    """`torch.save(model.module, f)` of an RNN failed with "cannot pickle
    'weakref.ReferenceType' object" (Note [Copies of the user's module]), and init_hidden's
    `weight.new_zeros` read the whole embedding out of its chunks and warned of a loss term
    that would train nothing (Note [New tensors like a parameter])."""
    expected, reference = word_language_model(kind, False, "loss", tmp_path / "plain.pt")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*PatrickStar")
        got, loaded = word_language_model(kind, True, backward, tmp_path / "ported.pt")
    assert type(loaded) is type(reference)
    assert all(type(p) is nn.Parameter for p in loaded.parameters())
    assert got == pytest.approx(expected, rel=1e-5)
    if kind != "Transformer":
        assert loaded.decoder.weight is loaded.encoder.weight  # still tied
        assert loaded.rnn._flat_weights[0] is loaded.rnn.weight_ih_l0
    for key, value in reference.state_dict().items():
        # The key part of attention's in_proj_bias has a zero gradient (softmax ignores a
        # constant per query): Adam scales its rounding noise up to lr steps, as for a bias
        # before a BatchNorm (docs/design.md, "The Python engine").
        tolerance = 1e-3 if key.endswith("in_proj_bias") else 1e-6
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=1e-5, atol=tolerance)


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


# --- minGPT (karpathy/minGPT, mingpt/model.py and mingpt/trainer.py) ---------------------------


class CfgNode:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(
            x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
            c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
            act=NewGELU(),
            dropout=nn.Dropout(config.resid_pdrop),
        ))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))  # submodules called directly

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.block_size = config.block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.embd_pdrop),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            torch.nn.init.zeros_(module.bias)
            torch.nn.init.ones_(module.weight)

    def configure_optimizers(self, train_config):
        decay, no_decay = set(), set()
        whitelist_weight_modules = (torch.nn.Linear, )
        blacklist_weight_modules = (torch.nn.LayerNorm, torch.nn.Embedding)
        for mn, m in self.named_modules():
            for pn, p in m.named_parameters():
                fpn = "%s.%s" % (mn, pn) if mn else pn
                if pn.endswith("bias"):
                    no_decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, whitelist_weight_modules):
                    decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, blacklist_weight_modules):
                    no_decay.add(fpn)
        param_dict = {pn: p for pn, p in self.named_parameters()}
        inter_params = decay & no_decay
        union_params = decay | no_decay
        assert len(inter_params) == 0, str(inter_params)
        assert len(param_dict.keys() - union_params) == 0, str(param_dict.keys() - union_params)
        optim_groups = [
            {"params": [param_dict[pn] for pn in sorted(list(decay))],
             "weight_decay": train_config.weight_decay},
            {"params": [param_dict[pn] for pn in sorted(list(no_decay))], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=train_config.learning_rate,
                                 betas=train_config.betas)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, do_sample=False, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.block_size else idx[:, -self.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            if do_sample:
                idx_next = torch.multinomial(probs, num_samples=1)
            else:
                _, idx_next = torch.topk(probs, k=1, dim=-1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


class MinGPTTrainer:
    """mingpt/trainer.py's run(); the port passes the optimizer in (`style="deepspeed"`: the
    engine's backward and step, clipping by the config's gradient_clipping)."""

    def __init__(self, config, model, train_dataset, optimizer=None, style="torch"):
        from collections import defaultdict
        self.config, self.train_dataset, self.optimizer, self.style = (
            config, train_dataset, optimizer, style)
        self.callbacks = defaultdict(list)
        self.device = "cpu"
        self.model = model.to(self.device)
        self.iter_num = 0

    def add_callback(self, onevent, callback):
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent):
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self):
        model, config = self.model, self.config
        if self.optimizer is None:
            self.optimizer = model.configure_optimizers(config)
        sampler = torch.utils.data.RandomSampler(self.train_dataset, replacement=True,
                                                 num_samples=int(1e10),
                                                 generator=torch.Generator().manual_seed(3))
        train_loader = torch.utils.data.DataLoader(self.train_dataset, sampler=sampler,
                                                   shuffle=False, batch_size=config.batch_size)
        model.train()
        self.iter_num = 0
        data_iter = iter(train_loader)
        while True:
            x, y = [t.to(self.device) for t in next(data_iter)]
            logits, self.loss = model(x, y)
            if self.style == "deepspeed":
                model.backward(self.loss)
                model.step()
            else:
                model.zero_grad(set_to_none=True)
                self.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
                self.optimizer.step()
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            if config.max_iters is not None and self.iter_num >= config.max_iters:
                break


class SortDataset(torch.utils.data.Dataset):
    """minGPT's demo.ipynb task: sort 6 digits of 3."""

    def __len__(self):
        return 1000

    def __getitem__(self, idx):
        inp = torch.randint(3, size=(6,), dtype=torch.long,
                            generator=torch.Generator().manual_seed(idx))
        cat = torch.cat((inp, torch.sort(inp)[0]), dim=0)
        x, y = cat[:-1].clone(), cat[1:].clone()
        y[:5] = -1
        return x, y


MINGPT = CfgNode(n_layer=2, n_head=2, n_embd=16, vocab_size=3, block_size=11, embd_pdrop=0.1,
                 resid_pdrop=0.1, attn_pdrop=0.1)
MINGPT_TRAIN = CfgNode(max_iters=6, batch_size=8, learning_rate=5e-3, betas=(0.9, 0.95),
                       weight_decay=0.1, grad_norm_clip=1.0)


def mingpt(ported, style="torch"):
    torch.manual_seed(0)
    optimizer = None
    if ported:
        config = {"optimizer": {"type": "AdamW", "params": {
            "lr": MINGPT_TRAIN.learning_rate, "betas": MINGPT_TRAIN.betas,
            "weight_decay": MINGPT_TRAIN.weight_decay}}, "default_chunk_size": 8192}
        if style == "deepspeed":
            config["gradient_clipping"] = MINGPT_TRAIN.grad_norm_clip
        model, optimizer = patrickstar.initialize(
            lambda: GPT(MINGPT), config=config,
            param_groups=lambda m: m.configure_optimizers(MINGPT_TRAIN).param_groups)
    else:
        model = GPT(MINGPT)
    trainer = MinGPTTrainer(MINGPT_TRAIN, model, SortDataset(), optimizer, style)
    losses, generated = [], []

    def batch_end_callback(trainer):
        losses.append(trainer.loss.item())
        if trainer.iter_num % 3 == 2:  # chargpt's sample in the middle of training
            model.eval()
            with torch.no_grad():
                generated.append(model.generate(torch.tensor([[2, 0, 1, 2, 0, 1]]), 5).tolist())
            model.train()

    trainer.add_callback("on_batch_end", batch_end_callback)
    trainer.run()
    model.eval()
    torch.manual_seed(5)
    generated.append(model.generate(torch.tensor([[2, 0, 1, 2, 0, 1]]), 5, temperature=0.8,
                                    do_sample=True, top_k=2).tolist())
    return losses, generated, model.state_dict()


@pytest.mark.parametrize("style", ["torch", "deepspeed"])
def test_mingpt_trainer_with_its_param_groups_trains_and_generates_as_the_plain_script(style):
    losses, generated, weights = mingpt(False)
    got_losses, got_generated, got_weights = mingpt(True, style)
    assert got_losses == pytest.approx(losses, rel=1e-5)
    assert got_generated == generated
    assert got_weights.keys() == weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(got_weights[key], value, rtol=1e-4, atol=1e-5)


def test_mingpt_trainer_left_to_configure_its_own_optimizer_names_the_one_to_use():
    model, _ = patrickstar.initialize(lambda: GPT(MINGPT), config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    trainer = MinGPTTrainer(MINGPT_TRAIN, model, SortDataset())
    with pytest.raises(RuntimeError, match="Use the optimizer patrickstar.initialize"):
        trainer.run()


# --- run_clm_no_trainer.py (Hugging Face transformers examples) with accelerate --------------

CLM_VOCAB = 64


class CLMTokens(torch.utils.data.Dataset):
    def __init__(self, count, offset=0):
        self.count, self.offset = count, offset

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        ids = torch.randint(0, CLM_VOCAB, (12,),
                            generator=torch.Generator().manual_seed(index + self.offset))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def run_clm_no_trainer(ported, output_dir, resume_from_checkpoint=None, prepare_module=False,
                       key_in_config=False):
    """The script's loop, tiny: accumulation 2, a linear schedule, clipping on the steps that
    sync, save_state at step 2 and a resume from it, evaluation and save_pretrained."""
    import os

    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    accelerate.utils.set_seed(0)

    def model_func():
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=CLM_VOCAB,
                                         n_positions=32, bos_token_id=0, eos_token_id=0)
        return transformers.AutoModelForCausalLM.from_config(config)  # tied embedding and head

    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]

    def grouped(model):
        return [
            {"params": [p for n, p in model.named_parameters()
                        if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters()
                        if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]

    if ported:
        config = {"optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.1}}}
        if key_in_config:
            config["gradient_accumulation_steps"] = 2
        engine, optimizer = patrickstar.initialize(model_func, config=config,
                                                   param_groups=grouped)
        model = engine.module if prepare_module else engine
    else:
        model = model_func()
        optimizer = torch.optim.AdamW(grouped(model), lr=5e-3)
    train_dataloader = torch.utils.data.DataLoader(CLMTokens(16), batch_size=4, shuffle=True)
    eval_dataloader = torch.utils.data.DataLoader(CLMTokens(8, 1000), batch_size=4)
    lr_scheduler = transformers.get_scheduler(name="linear", optimizer=optimizer,
                                              num_warmup_steps=1, num_training_steps=4)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    completed_steps, starting_epoch, resume_step = 0, 0, 0
    if resume_from_checkpoint:
        accelerator.load_state(resume_from_checkpoint)
        resume_step = 2 * accelerator.gradient_accumulation_steps
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = 2
        resume_step -= starting_epoch * len(train_dataloader)
    losses = []
    for epoch in range(starting_epoch, 2):
        model.train()
        active_dataloader = train_dataloader
        if resume_from_checkpoint and epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                completed_steps += 1
                if completed_steps == 2 and not resume_from_checkpoint:
                    accelerator.save_state(os.path.join(output_dir, "step_2"))
        model.eval()
        eval_losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            eval_losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(4)))
        losses.append(math.exp(torch.mean(torch.cat(eval_losses))))  # perplexity
    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(os.path.join(output_dir, "final"),
                                    is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save)
    weights = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(output_dir, "final")).state_dict()
    accelerate.state.AcceleratorState._reset_state(True)
    return losses, weights


@pytest.fixture(scope="module")
def plain_run_clm(tmp_path_factory):
    """The unported script's run and its resumed run, shared by the variants below."""
    root = tmp_path_factory.mktemp("plain_clm")
    return (run_clm_no_trainer(False, root / "plain"),
            run_clm_no_trainer(False, root / "resumed", resume_from_checkpoint=root / "plain" /
                               "step_2"))


@pytest.mark.parametrize("variant", ["engine", "module", "key_in_config"])
def test_run_clm_no_trainer_with_accelerate_trains_resumes_and_saves_as_the_plain_script(
        tmp_path, plain_run_clm, variant):
    """prepare() of the engine or of model.module; the accumulation left to accelerate or also
    in the config."""
    options = {"prepare_module": variant == "module", "key_in_config": variant == "key_in_config"}
    runs = [(plain_run_clm[0], run_clm_no_trainer(True, tmp_path / "ported", **options))]
    if variant != "key_in_config":  # a new run resumed from step 2's save_state
        runs.append((plain_run_clm[1], run_clm_no_trainer(
            True, tmp_path / "resumed", resume_from_checkpoint=tmp_path / "ported" / "step_2",
            **options)))
    for (expected, weights), (got, got_weights) in runs:
        assert got == pytest.approx(expected, rel=1e-5)
        for key, value in weights.items():
            torch.testing.assert_close(got_weights[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_the_original_hand_written_sgd_update_names_the_optimizer_to_use(monkeypatch):
    """main.py's `p.data.add_(p.grad, alpha=-lr)`: p.grad stays None (gradients live in chunks)
    and torch's TypeError named only NoneType (Note [p.grad after a backward])."""
    from patrickstar import resting_params
    monkeypatch.setattr(resting_params, "_warned_gradient_in_chunks", False)
    model, _ = patrickstar.initialize(lambda: RNNModel("GRU", 20, 8, 8, 2, 0.0), config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(p.grad is None for p in model.parameters())  # before a backward: quiet
    hidden = model.init_hidden(2)
    output, hidden = model(torch.randint(0, 20, (5, 2)), hidden)
    nn.NLLLoss()(output, torch.randint(0, 20, (10,))).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    with pytest.warns(UserWarning, match=r"p\.grad of PatrickStar parameter 'module\.encoder"
                                         r"\.weight' is None after the backward.*full_gradient"):
        with pytest.raises(TypeError, match="NoneType"):
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-20)


def test_ddp_around_the_engines_module_names_the_engine_to_prepare():
    """Under torchrun accelerate's prepare(model.module) wraps the module in DDP, whose
    constructor failed on a lost write naming neither (Note [DDP around an engine's module]).
    The check comes before torch's constructor, so no process group is needed here."""
    model, _ = patrickstar.initialize(lambda: nn.Linear(3, 4), config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel around a module whose "
                                           r"parameters live in a PatrickStar engine.*'weight'"
                                           r".*pass the engine to accelerator.prepare\(\)"):
        nn.parallel.DistributedDataParallel(model.module)
    with pytest.raises((RuntimeError, ValueError), match="process group"):  # torch's own
        nn.parallel.DistributedDataParallel(nn.Linear(3, 4))


def test_one_rank_saving_the_module_under_data_parallelism_is_served(tmp_path):
    """`if rank == 0: torch.save(model.module, f)` (and parameters_to_vector there) gathered
    without the ranks' agreement, so rank 0's gather met rank 1's next forward and both waited
    until the collective timeout."""
    import os

    from canonical_worker import batches, train_step
    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "canonical_worker.py")
    results = launch(tmp_path, 2, worker=worker)
    assert results[0] and results[1], "a rank did not finish"
    saved = results[0]["saved"]
    assert saved is not None and results[1]["saved"] is None
    torch.manual_seed(0)
    reference = RNNModel("LSTM", 20, 8, 8, 2, 0.0, True)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step, (data, targets) in zip(range(2), batches()):  # the weights rank 0 saved
        train_step(reference, optimizer, data, targets)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(results[0]["vector"], torch.nn.utils.parameters_to_vector(
        reference.parameters()).detach(), rtol=1e-5, atol=1e-6)
