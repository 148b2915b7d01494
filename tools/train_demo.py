"""Train the embedded demo model: a tiny llama that has memorized the Zen of Python.

The text is `import this` (public domain, on every machine with Python), so `make demo` needs no download.
The vocabulary is a byte-level BPE learned on the Zen itself (it runs out of pairs after ~290 merges, so every
Zen word is one token), and the model is trained with tinygrad on random windows of "Zen<eos>Zen<eos>...".

    python tools/train_demo.py --out pp_worker/data/zen.gguf [--steps N]
    python tools/train_demo.py --draft --out pp_worker/data/zen-draft.gguf   # its draft model (--draft-model)

Determinism: the initial weights come from `modelgen.random_weights` (seeded numpy) and the windows from a
seeded numpy generator; nothing else is random. The same tinygrad version on the same CPU therefore writes a
byte-identical file. Other CPUs or compilers may round differently, so bit-exactness across machines is not
promised: the committed `zen.gguf` is the artifact, and this script is how it was made.

The default 80 steps take ~4 minutes on 2 CPU cores. The loss levels off near 0.03, not 0: the first tokens
of a window have too little context to be predictable; greedy decoding still recites every line exactly.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pp_worker.testing.bpe import Vocab, build_vocab  # noqa: E402
from pp_worker.testing.modelgen import LlamaSpec, random_weights, write_gguf  # noqa: E402

SPEC = LlamaSpec(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, context_length=256)
# the draft model (pp-pipeline --draft-model): the same vocabulary and text, a fraction of the compute per token
DRAFT_SPEC = LlamaSpec(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=192, context_length=256)
N_MERGES = 300  # more than the Zen has pairs for: build_vocab stops at the last one (vocab 550)
SEED = 0
# (batch, window) pairs trained together each step. Long windows exceed one "Zen<eos>" (177 tokens), so the
# whole text is seen at every offset; short ones make the first few positions (a short prompt with no Zen
# before it, e.g. "Beautiful is better than" at position 0) as well trained as the rest.
WINDOWS = ((4, 192), (32, 24))
LR, WARMUP = 3e-3, 30


def zen_text() -> str:
    """The Zen of Python, exactly as `import this` prints it (without the final newline)."""
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen to stdout
        import this
    return codecs.decode(this.s, "rot13")


def load_tokenizer(vocab: Vocab):
    """tinygrad's SimpleTokenizer, built the way inference builds it: from the kv of a GGUF with this vocab."""
    from tinygrad.llm.cli import SimpleTokenizer
    from tinygrad.llm.gguf import gguf_load

    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "vocab.gguf", SPEC, random_weights(SPEC, len(vocab.tokens), SEED), vocab)
        kv, _ = gguf_load(str(path))
    return SimpleTokenizer.from_gguf_kv(kv)


def training_tokens(tokenizer, eos_id: int) -> np.ndarray:
    """One cycle of the training stream, "Zen<eos>", as token ids (n,); windows wrap around it."""
    return np.array(tokenizer.encode(zen_text()) + [eos_id], dtype=np.int32)


class TrainModel:
    """Training-time llama forward with the same math as tinygrad's `TransformerBlock` (prefill from position 0).

    Attribute names mirror tinygrad's `Transformer`, so `nn.state.get_state_dict` yields GGUF tensor names.
    Q/K rows are in HF half-split rope order, as `apply_rope` expects and `write_gguf` wants.
    """

    def __init__(self, spec: LlamaSpec, weights: dict[str, np.ndarray]):
        from tinygrad import Tensor, nn

        self.spec = spec
        vocab_size, d, kv = weights["token_embd.weight"].shape[0], spec.dim, spec.n_kv_heads * spec.head_dim
        self.token_embd = nn.Embedding(vocab_size, d)
        self.blk = [_Block(spec, d, kv) for _ in range(spec.n_layers)]
        self.output_norm = nn.RMSNorm(d, spec.norm_eps)
        self.output = nn.Linear(d, vocab_size, bias=False)
        state = {k: Tensor(v) for k, v in weights.items()}
        nn.state.load_state_dict(self, state, verbose=False)

    def __call__(self, tokens):
        """tokens (B, T) int32 -> logits (B, T, V)."""
        from tinygrad.llm.model import precompute_freqs_cis

        freqs = precompute_freqs_cis(self.spec.head_dim, self.spec.context_length, self.spec.rope_theta)
        freqs = freqs[: tokens.shape[1]]  # (T, head_dim): cos | sin halves
        x = self.token_embd(tokens).float()  # (B, T, D)
        for block in self.blk:
            x = block(x, freqs)
        return self.output(self.output_norm(x))


class _Block:
    def __init__(self, spec: LlamaSpec, d: int, kv: int):
        from tinygrad import nn

        self.spec = spec
        self.attn_norm, self.ffn_norm = nn.RMSNorm(d, spec.norm_eps), nn.RMSNorm(d, spec.norm_eps)
        self.attn_q, self.attn_k = nn.Linear(d, d, bias=False), nn.Linear(d, kv, bias=False)
        self.attn_v, self.attn_output = nn.Linear(d, kv, bias=False), nn.Linear(d, d, bias=False)
        self.ffn_gate, self.ffn_up = nn.Linear(d, spec.ffn_dim, bias=False), nn.Linear(d, spec.ffn_dim, bias=False)
        self.ffn_down = nn.Linear(spec.ffn_dim, d, bias=False)

    def _attention(self, x, freqs):
        from tinygrad.llm.model import apply_rope

        (B, T, _), s = x.shape, self.spec
        q = self.attn_q(x).reshape(B, T, s.n_heads, s.head_dim).transpose(1, 2)  # (B, H, T, Hd)
        k = self.attn_k(x).reshape(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        v = self.attn_v(x).reshape(B, T, s.n_kv_heads, s.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        attn = q.scaled_dot_product_attention(k, v, is_causal=True, enable_gqa=True)  # (B, H, T, Hd)
        return self.attn_output(attn.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)

    def __call__(self, x, freqs):
        h = x + self._attention(self.attn_norm(x), freqs)  # (B, T, D)
        f = self.ffn_norm(h)
        return h + self.ffn_down(self.ffn_gate(f).silu() * self.ffn_up(f))  # SwiGLU


def sample_batch(rng: np.random.Generator, cycle: np.ndarray, batch: int, window: int) -> tuple[np.ndarray, ...]:
    """Random windows of the endless "Zen<eos>" stream -> (inputs, targets), each (batch, window) int32."""
    stream = np.tile(cycle, window // len(cycle) + 2)
    starts = rng.integers(0, len(cycle), batch)
    rows = np.stack([stream[s : s + window + 1] for s in starts])  # (batch, window+1)
    return rows[:, :-1], rows[:, 1:]


def lr_at(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay to LR/10."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    frac = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(model: TrainModel, cycle: np.ndarray, steps: int) -> float:
    """Adam on next-token cross-entropy; returns the mean loss of the last 10 steps."""
    from tinygrad import Tensor, TinyJit, nn

    opt = nn.optim.Adam(nn.state.get_parameters(model), lr=LR)

    @TinyJit
    @Tensor.train()
    def step(*xy: Tensor) -> Tensor:  # x0, y0, x1, y1, ...: one (inputs, targets) pair per WINDOWS entry
        opt.zero_grad()
        losses = [model(x).sparse_categorical_crossentropy(y) for x, y in zip(xy[::2], xy[1::2], strict=True)]
        loss = (sum(losses[1:], losses[0]) / len(losses)).backward()
        opt.step()
        return loss.realize()

    rng, losses, t0 = np.random.default_rng(SEED), [], time.perf_counter()
    for i in range(steps):
        opt.lr.assign(Tensor([lr_at(i, steps)], device=opt.lr.device)).realize()
        xy = [Tensor(a) for b, w in WINDOWS for a in sample_batch(rng, cycle, b, w)]
        losses.append(float(step(*xy).numpy()))
        if i % 20 == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.4f}  {time.perf_counter() - t0:6.1f}s", file=sys.stderr)
    return float(np.mean(losses[-10:]))


def export_weights(model: TrainModel) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array (out, in), the layout `write_gguf` takes."""
    from tinygrad import nn

    return {k: v.numpy().astype(np.float32) for k, v in nn.state.get_state_dict(model).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("pp_worker/data/zen.gguf"))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--draft", action="store_true", help="train the smaller draft model (DRAFT_SPEC) instead")
    args = ap.parse_args(argv)
    spec, name = (DRAFT_SPEC, "pp-worker-zen-draft") if args.draft else (SPEC, "pp-worker-zen")
    vocab = build_vocab(zen_text(), N_MERGES)
    cycle = training_tokens(load_tokenizer(vocab), vocab.eos_id)
    print(f"vocab {len(vocab.tokens)}, Zen<eos> = {len(cycle)} tokens", file=sys.stderr)
    model = TrainModel(spec, random_weights(spec, len(vocab.tokens), SEED))
    loss = train(model, cycle, args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(args.out, spec, export_weights(model), vocab, dtype="F16", name=name)
    print(f"final loss {loss:.4f}; wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
