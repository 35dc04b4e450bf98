"""A GGUF file of a real model's shapes with random blocks: what a big download looks like to the
loader, without the download.

Only the shapes and the block types matter for what loading costs (bytes read, memory held, the
layouts packed), so the blocks are random bytes with their float16 scales set to small finite
values. The mix of types follows one of llama.cpp's recipes in outline (:data:`MIXES`): for
Q4_K_M, Q4_K for most matrices, Q6_K for the value projection and the FFN's down projection in
every other layer and for the LM head; Q5_K_M the same with Q5_K; Q8_0 every matrix in Q8_0.
``llmlib bench memory`` and the tests use it to load an 8B model's shapes in a small machine's
memory, and the 8B benchmarks to compare llama.cpp and llmlib on the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from llmlib.config import ModelConfig, get_config

T = gguf.GGMLQuantizationType
#: where each block type keeps its float16 scales: (byte offsets in the block)
_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q4_0: (0,)}
#: llmlib's name of a matrix -> GGUF's, for one layer
_NAMES = {
    "attn.wq": "attn_q",
    "attn.wk": "attn_k",
    "attn.wv": "attn_v",
    "attn.wo": "attn_output",
    "ffn.w_gate": "ffn_gate",
    "ffn.w_up": "ffn_up",
    "ffn.w_down": "ffn_down",
}


def q4_k_m_type(name: str, layer: int | None) -> T:
    """The block type of one matrix in an outline of llama.cpp's Q4_K_M mix."""
    return mix_type("Q4_K_M", name, layer)


#: llama.cpp's file types this module outlines: the type of most matrices
MIXES = {"Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q8_0": T.Q8_0}


def mix_type(mix: str, name: str, layer: int | None) -> T:
    """The block type of one matrix in an outline of llama.cpp's ``mix`` (:data:`MIXES`): the
    K-quant mixes keep the LM head, and the value and down projections of every other layer, in
    Q6_K; Q8_0 keeps every matrix in Q8_0."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; one of {sorted(MIXES)}")
    if mix.endswith("_M"):
        if name == "output":
            return T.Q6_K
        if name in ("attn_v", "ffn_down") and layer is not None and layer % 2 == 0:
            return T.Q6_K
    return MIXES[mix]


#: GGUF's general.file_type of each mix (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
_FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q8_0": 7}


def random_blocks(rows: int, cols: int, t: T, rng: np.random.Generator) -> np.ndarray:
    """``[rows, bytes per row]`` of random blocks of type ``t`` with small finite scales."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    for off in _SCALES[t]:
        raw[:, off : off + 2] = scale
    if t == T.Q6_K:  # the sub-block scales are int8: keep them small too
        raw[:, 192:208] = rng.integers(1, 8, size=(n, 16), dtype=np.uint8)
    return raw.reshape(rows, cols // block * size)


def write_random_gguf(
    path: str | Path,
    cfg: ModelConfig | str = "llama-3.1-8b",
    n_layers: int | None = None,
    seed=0,
    vocab: bool = False,
    mix: str = "Q4_K_M",
) -> Path:
    """Write ``cfg``'s shapes (``n_layers`` of its layers, all by default) as a llama GGUF file
    of random blocks in an outline of llama.cpp's ``mix`` (:data:`MIXES`); float32 norms. Tensor
    by tensor, so the writer never holds more than one matrix. ``vocab``: also a
    SentencePiece-style vocabulary of the model's size (the 256 byte tokens, then made-up
    pieces), so that tools that need one (llama.cpp, the benchmarks' prompts) run on the
    file."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    cfg = cfg.replace(rope_scaling=None, n_layers=n_layers or cfg.n_layers)
    path = Path(path)
    rng = np.random.default_rng(seed)
    d, hd = cfg.d_model, cfg.head_dim
    shapes: list[tuple[str, tuple[int, ...], int | None]] = [
        ("token_embd", (cfg.vocab_size, d), None)
    ]
    for i in range(cfg.n_layers):
        shapes += [
            (f"blk.{i}.attn_norm", (d,), i),
            (f"blk.{i}.attn_q", (cfg.n_heads * hd, d), i),
            (f"blk.{i}.attn_k", (cfg.n_kv_heads * hd, d), i),
            (f"blk.{i}.attn_v", (cfg.n_kv_heads * hd, d), i),
            (f"blk.{i}.attn_output", (d, cfg.n_heads * hd), i),
            (f"blk.{i}.ffn_norm", (d,), i),
            (f"blk.{i}.ffn_gate", (cfg.ffn_dim, d), i),
            (f"blk.{i}.ffn_up", (cfg.ffn_dim, d), i),
            (f"blk.{i}.ffn_down", (d, cfg.ffn_dim), i),
        ]
    shapes += [("output_norm", (d,), None)]
    if not cfg.tie_embeddings:
        shapes += [("output", (cfg.vocab_size, d), None)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"{cfg.name} (random blocks)")
    w.add_file_type(_FILE_TYPES[mix])
    w.add_block_count(cfg.n_layers)
    w.add_context_length(min(cfg.max_seq_len, 8192))
    w.add_embedding_length(d)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id or 0)
    w.add_eos_token_id(cfg.eos_token_ids[0] if cfg.eos_token_ids else 0)
    if vocab:
        _add_vocab(w, cfg.vocab_size)
    types = {}
    for name, shape, layer in shapes:
        t = T.F32 if len(shape) == 1 else mix_type(mix, name.rpartition(".")[2], layer)
        types[name] = t
        if t == T.F32:
            w.add_tensor_info(f"{name}.weight", shape, np.dtype(np.float32), 4 * shape[0])
        else:
            nbytes = (
                shape[0] * shape[1] // gguf.GGML_QUANT_SIZES[t][0] * gguf.GGML_QUANT_SIZES[t][1]
            )
            byte_shape = (shape[0], nbytes // shape[0])
            w.add_tensor_info(f"{name}.weight", byte_shape, np.dtype(np.uint8), nbytes, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, _ in shapes:
        if types[name] == T.F32:
            w.write_tensor_data(np.ones(shape, np.float32))
        else:
            w.write_tensor_data(random_blocks(shape[0], shape[1], types[name], rng))
    w.close()
    return path


def _add_vocab(w: gguf.GGUFWriter, size: int) -> None:
    """A SentencePiece ("llama") vocabulary of ``size`` pieces: ``<unk>``, ``<s>``, ``</s>``, the
    256 byte tokens ``<0x00>`` ... ``<0xFF>``, then ``▁`` and letters' pairs and numbered pieces
    with falling scores. It decodes any text (through the bytes) and encodes it reproducibly."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["\u2581"] + [f"\u2581{a}" for a in letters] + [a + b for a in letters for b in letters]
    words += [f"\u2581w{i}" for i in range(size - len(pieces) - len(words))]
    pieces += words[: size - len(pieces)]
    kinds += [1] * (size - len(kinds))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(size - 259)])
    w.add_token_types(kinds)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    # a plain template: the messages' text, one per line, then the answer
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


def main(argv: list[str] | None = None) -> int:
    """``llmlib bench gguf_synth OUT``: write such a file (the 8B benchmarks' input)."""
    import argparse

    from llmlib.config import PRESETS

    ap = argparse.ArgumentParser(
        prog="llmlib bench gguf_synth", description=__doc__.splitlines()[0]
    )
    ap.add_argument("out", help="the .gguf file to write")
    ap.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--mix", default="Q4_K_M", choices=sorted(MIXES))
    ap.add_argument("--layers", type=int, default=None, help="the first N layers (default: all)")
    ap.add_argument("--no-vocab", action="store_true", help="no vocabulary (llama.cpp needs one)")
    args = ap.parse_args(argv)
    path = write_random_gguf(
        args.out, args.preset, n_layers=args.layers, vocab=not args.no_vocab, mix=args.mix
    )
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB, {args.preset} in {args.mix}")
    return 0
