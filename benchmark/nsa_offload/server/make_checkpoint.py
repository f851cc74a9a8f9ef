"""Write a DeepSeek-V3.2-shaped safetensors checkpoint whose weights make
attention matter, for end-to-end exactness checks through sglang's own loader.

sglang's ``--load-format dummy`` fills every parameter, RMSNorm weights
included, with U(-1e-3, 1e-3): each layer's attention then adds less than bf16
resolution to the residual and greedy tokens barely depend on the KV cache, so
an offload that reads a wrong KV row still gives the same tokens. This script
writes random weights at a trained-like scale instead:

* norms (RMSNorm weights, the indexer's LayerNorm) are 1 (bias 0);
* the token embedding is N(0, 1), so every residual row starts at unit RMS;
* every projection ``W[out, in]`` is N(0, 1/in) (unit gain by fan-in), so each
  layer's attention and MLP change the residual by about as much as it holds;
* ``--qk-gain`` scales the query (``q_b_proj``) and the key rows of
  ``kv_b_proj``: attention logits get a standard deviation of about
  ``qk_gain**2`` times yarn's softmax scale, i.e. sharper attention;
* ``--out-gain`` scales every projection that writes the residual
  (``o_proj``, ``down_proj``), making the blocks dominate the residual;
* ``--attn-out-gain`` scales ``o_proj`` alone: random keys give near-uniform
  attention, whose output over n rows is ~n**-0.5 of a value row, so over a
  2048-row top-k the attention writes ~2% of the residual at gain 1 and one
  KV row ~1/2048 of that; this gain restores attention's share of the
  residual (a trained model's attention is peaked, not an average);
* MoE routers are N(0, 1/hidden) with zero score-correction bias (noaux_tc).

Every tensor is drawn from its own generator seeded by ``(seed, name)``, so the
weights do not depend on the order or the device they are drawn on, and the
NextN (MTP) layer (``model.layers.<num_hidden_layers>``) is written as a real
checkpoint has it. Servers load it with sglang's normal loader
(``--load-format auto``, the default): nothing large goes into git, it is
generated on the GPU host at run time (``tiny`` ~0.4 GB in seconds, ``rank``
~39 GB in about a minute).

    python benchmark/nsa_offload/server/make_checkpoint.py --config tiny --out /tmp/ckpt_tiny
    python benchmark/nsa_offload/server/make_checkpoint.py --config rank --out /tmp/ckpt_rank --device cuda
"""

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
CONFIGS = {
    # Today's 3-layer, 1024-wide model (fast checks, soak).
    "tiny": HERE / "tiny_dsv32_config.json",
    # One DeepSeek-V3.2 DP-attention rank: full attention width, 61 layers;
    # only the experts and the vocab are shrunk so it fits one H200.
    "rank": HERE / "rank_dsv32_config.json",
}
SHARD_BYTES = 4 << 30
# The gains of the checkpoint of record (the command-line defaults here, in
# exactness.py and soak.py, and the GPU test's): the negative control's sweep
# (results/exactness/nc_sweep/) found that one wrong KV row read once changes
# 90.6% of the tiny model's outputs at these, the most of the gains tried.
RECORD_QK_GAIN = 1.5
RECORD_OUT_GAIN = 16.0

# (name suffix, shape as a function of the config, init kind)
# kinds: "norm" (ones), "zeros", "embed" (N(0, 1)), "linear" (N(0, 1/in)),
# "qb" / "kvb" / "out" / "attn_out" (linear with the gains applied).


def _attention_tensors(c: dict) -> List[Tuple[str, Tuple[int, ...], str]]:
    h = c["hidden_size"]
    heads = c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    return [
        ("self_attn.q_a_proj.weight", (q_lora, h), "linear"),
        ("self_attn.q_a_layernorm.weight", (q_lora,), "norm"),
        ("self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), "qb"),
        ("self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), "linear"),
        ("self_attn.kv_a_layernorm.weight", (kv_lora,), "norm"),
        ("self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora), "kvb"),
        ("self_attn.o_proj.weight", (h, heads * v), "attn_out"),
        ("self_attn.indexer.wq_b.weight", (ih * idim, q_lora), "linear"),
        ("self_attn.indexer.wk.weight", (idim, h), "linear"),
        ("self_attn.indexer.k_norm.weight", (idim,), "norm"),
        ("self_attn.indexer.k_norm.bias", (idim,), "zeros"),
        ("self_attn.indexer.weights_proj.weight", (ih, h), "linear"),
    ]


def _mlp_tensors(c: dict, layer: int) -> List[Tuple[str, Tuple[int, ...], str]]:
    h = c["hidden_size"]
    if layer < c["first_k_dense_replace"]:
        inter = c["intermediate_size"]
        return [
            ("mlp.gate_proj.weight", (inter, h), "linear"),
            ("mlp.up_proj.weight", (inter, h), "linear"),
            ("mlp.down_proj.weight", (h, inter), "out"),
        ]
    inter = c["moe_intermediate_size"]
    shared = inter * c["n_shared_experts"]
    out = [
        ("mlp.gate.weight", (c["n_routed_experts"], h), "linear"),
        ("mlp.gate.e_score_correction_bias", (c["n_routed_experts"],), "zeros32"),
        ("mlp.shared_experts.gate_proj.weight", (shared, h), "linear"),
        ("mlp.shared_experts.up_proj.weight", (shared, h), "linear"),
        ("mlp.shared_experts.down_proj.weight", (h, shared), "out"),
    ]
    for e in range(c["n_routed_experts"]):
        out += [
            (f"mlp.experts.{e}.gate_proj.weight", (inter, h), "linear"),
            (f"mlp.experts.{e}.up_proj.weight", (inter, h), "linear"),
            (f"mlp.experts.{e}.down_proj.weight", (h, inter), "out"),
        ]
    return out


def checkpoint_tensors(c: dict) -> List[Tuple[str, Tuple[int, ...], str]]:
    """Every tensor of a DeepSeek-V3.2 checkpoint for config ``c``, in the
    HF naming sglang's DeepSeek loader reads (NextN layer included)."""
    h, vocab = c["hidden_size"], c["vocab_size"]
    n = c["num_hidden_layers"]
    out = [("model.embed_tokens.weight", (vocab, h), "embed")]
    for i in range(n + c.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "norm")]
        out += [(p + s, shape, k) for s, shape, k in _attention_tensors(c)]
        out += [(p + "post_attention_layernorm.weight", (h,), "norm")]
        out += [(p + s, shape, k) for s, shape, k in _mlp_tensors(c, i)]
        if i >= n:
            out += [
                (p + "enorm.weight", (h,), "norm"),
                (p + "hnorm.weight", (h,), "norm"),
                (p + "eh_proj.weight", (h, 2 * h), "linear"),
                (p + "shared_head.norm.weight", (h,), "norm"),
                (p + "shared_head.head.weight", (vocab, h), "linear"),
                (p + "embed_tokens.weight", (vocab, h), "embed"),
            ]
    out += [
        ("model.norm.weight", (h,), "norm"),
        ("lm_head.weight", (vocab, h), "linear"),
    ]
    return out


def tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def make_tensor(
    name, shape, kind, c, seed, qk_gain, out_gain, device, attn_out_gain=1.0
):
    import torch

    if kind == "norm":
        return torch.ones(shape, dtype=torch.bfloat16)
    if kind in ("zeros", "zeros32"):
        dtype = torch.float32 if kind == "zeros32" else torch.bfloat16
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    w = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if kind != "embed":
        w *= shape[1] ** -0.5
    if kind == "qb":
        w *= qk_gain
    elif kind == "kvb":
        # Rows per head: qk_nope_head_dim key rows, then v_head_dim value rows.
        nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
        w.view(c["num_attention_heads"], nope + v, -1)[:, :nope] *= qk_gain
    elif kind == "out":
        w *= out_gain
    elif kind == "attn_out":
        w *= out_gain * attn_out_gain
    return w.to(torch.bfloat16).cpu()


def write_checkpoint(
    config: dict,
    out_dir: str,
    seed: int = 0,
    qk_gain: float = 1.0,
    out_gain: float = 1.0,
    device: str = "cpu",
    progress=print,
    attn_out_gain: float = 1.0,
) -> dict:
    """Write ``config.json``, the safetensors shards and their index into
    ``out_dir``; returns the metadata also written to ``checkpoint_meta.json``."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = checkpoint_tensors(config)
    total = checkpoint_bytes(config)
    shards: List[List[Tuple[str, Tuple[int, ...], str]]] = [[]]
    size = 0
    for t in tensors:
        b = _numel(t[1]) * 2
        if shards[-1] and size + b > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += b
    weight_map: Dict[str, str] = {}
    tic = time.time()
    done = 0
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for name, shape, kind in shard:
            data[name] = make_tensor(
                name,
                shape,
                kind,
                config,
                seed,
                qk_gain,
                out_gain,
                device,
                attn_out_gain,
            )
            weight_map[name] = fname
            done += data[name].numel() * data[name].element_size()
        save_file(data, os.path.join(out_dir, fname), metadata={"format": "pt"})
        progress(
            f"[make_checkpoint] {fname}: {done / 2**30:.1f} / {total / 2**30:.1f} GiB "
            f"({time.time() - tic:.0f} s)"
        )
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    meta = {
        "weights": "checkpoint",
        "seed": seed,
        "qk_gain": qk_gain,
        "out_gain": out_gain,
        "attn_out_gain": attn_out_gain,
        "num_tensors": len(tensors),
        "total_bytes": total,
        "num_hidden_layers": config["num_hidden_layers"],
        "num_nextn_predict_layers": config.get("num_nextn_predict_layers", 0),
        "wall_s": round(time.time() - tic, 1),
    }
    with open(os.path.join(out_dir, "checkpoint_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def checkpoint_bytes(config: dict) -> int:
    """Bytes of the checkpoint of ``config`` (bf16 tensors, fp32 biases)."""
    tensors = checkpoint_tensors(config)
    return sum(_numel(s) * (4 if k == "zeros32" else 2) for _, s, k in tensors)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def load_config(name_or_path: str) -> dict:
    path = CONFIGS.get(name_or_path, Path(name_or_path))
    if not Path(path).is_file():
        raise SystemExit(
            f"make_checkpoint: no config {name_or_path!r} "
            f"(one of {', '.join(CONFIGS)} or a config.json path)"
        )
    with open(path) as f:
        return json.load(f)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        default="tiny",
        help="tiny (3 layers, 1024 wide), rank (61 layers, DeepSeek-V3.2 attention "
        "width) or a config.json path",
    )
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0, help="weights' seed")
    p.add_argument(
        "--qk-gain",
        type=float,
        default=RECORD_QK_GAIN,
        help=f"gain on queries and keys (attention sharpness; {RECORD_QK_GAIN:g})",
    )
    p.add_argument(
        "--out-gain",
        type=float,
        default=RECORD_OUT_GAIN,
        help=f"gain on the projections that write the residual ({RECORD_OUT_GAIN:g})",
    )
    p.add_argument(
        "--attn-out-gain",
        type=float,
        default=1.0,
        help="further gain on the attention output projection (o_proj) alone",
    )
    p.add_argument(
        "--device", default="cpu", help="where to draw the weights (cpu or cuda)"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = load_config(args.config)
    meta = write_checkpoint(
        config,
        args.out,
        args.seed,
        args.qk_gain,
        args.out_gain,
        args.device,
        attn_out_gain=args.attn_out_gain,
    )
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
