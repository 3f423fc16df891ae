"""`moeshard inspect MODEL`: geometry, formats, sizes, shard files and their checksum status."""

from __future__ import annotations

from pathlib import Path

from moeshard.moe.kernels import quant
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.manifest import ROLE_COORDINATOR, ROLE_NODE, TRUNK_FILE
from moeshard.moe.storage.merkle import ROOTS_FILE
from moeshard.moe.units import fmt_bytes


def describe(path: str | Path, verify: bool = False) -> tuple[str, bool]:
    """The report text, and whether every checked checksum passed."""
    model = ModelDir(path)
    c, m = model.config, model.manifest
    lines = [f"model      {model.path}", f"model id   {model.model_id}"]
    lines.append(
        f"family     {c.model_type}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"vocab {c.vocab_size}"
    )
    if getattr(c, "kda_layers", None) is not None:  # Kimi Linear: KDA and MLA layers
        kda, mla = ",".join(map(str, c.kda_layers)), ",".join(map(str, c.mla_layers))
        lines.append(
            f"attention  (layers from 0) KDA {kda or '-'} ({c.kda_heads} heads of "
            f"{c.kda_head_dim}, state {fmt_bytes(c.state_bytes())}); MLA {mla or '-'} "
            f"(latent {c.kv_lora_rank}, no positions)"
        )
    if getattr(c, "linear_layers", None) is not None:  # Qwen3-Next / Qwen3.5: Gated DeltaNet
        lin, full = ",".join(map(str, c.linear_layers)), ",".join(map(str, c.full_layers))
        vision = "; vision tower not run" if c.has_vision else ""
        lines.append(
            f"attention  (layers from 0) Gated DeltaNet {lin or '-'} ({c.linear_key_heads} key "
            f"and {c.linear_value_heads} value heads of {c.linear_key_dim}/{c.linear_value_dim}, "
            f"state {fmt_bytes(c.state_bytes())}); gated attention {full or '-'} "
            f"({c.num_attention_heads}/{c.num_key_value_heads} heads of {c.head_dim}, rotary "
            f"{c.rope.dim}){vision}"
        )
    if getattr(c, "swiglu_limit", None) is not None:  # gpt-oss
        windowed = [i for i in range(c.num_hidden_layers) if c.window(i)]
        full = [i for i in range(c.num_hidden_layers) if not c.window(i)]
        lines.append(
            f"attention  (layers from 0) window {max(map(c.window, windowed), default=0)} on "
            f"{','.join(map(str, windowed)) or '-'}, full on {','.join(map(str, full)) or '-'} "
            f"({c.num_attention_heads}/{c.num_key_value_heads} heads of {c.head_dim}, a sink "
            f"per head); experts with biases, clamped SwiGLU (alpha {c.swiglu_alpha:g}, limit "
            f"{c.swiglu_limit:g})"
        )
    if getattr(c, "latent_size", None) is not None:  # Kimi K3's additions
        vision = "; vision tower not run" if c.has_vision else ""
        lines.append(
            f"kimi k3    LatentMoE (experts in latent {c.latent_size}, {c.n_shared_experts} "
            f"shared at full width), SiTU-GLU (beta {c.situ_beta:g}, linear beta "
            f"{c.situ_linear_beta:g}), attention residuals in blocks of "
            f"{c.attn_res_block_size}, KDA gate bound {c.gate_lower_bound:g}{vision}"
        )
    lines.append(
        f"experts    {c.n_experts} per MoE layer x {len(c.moe_layers)} MoE layers, "
        f"{c.top_k} active per token, intermediate {c.expert_intermediate}"
    )
    record = quant.expert_record_nbytes(model.expert_format, c.expert_hidden, c.expert_intermediate)
    n_records = len(model.locations)
    expert_total = n_records * record
    trunk_path = model.path / TRUNK_FILE
    trunk_bytes = trunk_path.stat().st_size if trunk_path.exists() else 0
    lines.append(
        f"formats    experts {model.expert_format}, trunk {m.get('trunk_format', '-')} "
        f"(norms, biases and routers f32)"
    )
    params = m.get("params", {})
    if params:
        total = params.get("trunk", 0) + params.get("experts", 0)
        lines.append(
            f"params     {total / 1e6:,.2f} M (trunk {params.get('trunk', 0) / 1e6:,.2f} M, "
            f"experts {params.get('experts', 0) / 1e6:,.2f} M)"
        )
    active = f"active per token {fmt_bytes(record * c.top_k * len(c.moe_layers))} of experts"
    if model.role == ROLE_COORDINATOR:
        roots = model.possession_roots()  # checked on opening: one per record of the model
        lines.append(
            "directory  coordinator (made by `moeshard shard`): the trunk, no expert records; "
            f"generate with --peers or --discover; {len(roots.keys())} Merkle roots "
            f"({ROOTS_FILE}) to check the nodes' records against"
        )
        lines.append(
            f"sizes      total {fmt_bytes(trunk_bytes)}; trunk {fmt_bytes(trunk_bytes)}; "
            f"experts on the nodes: {fmt_bytes(len(roots.keys()) * record)} "
            f"({len(roots.keys())} records of {fmt_bytes(record)}); {active}"
        )
    else:
        if model.role == ROLE_NODE:
            lines.append(
                f"directory  a node's shard directory (made by `moeshard shard`): "
                f"{n_records} of the model's {len(model.expert_keys())} expert records, no trunk"
            )
        lines.append(
            f"sizes      total {fmt_bytes(trunk_bytes + expert_total)}; "
            f"trunk {fmt_bytes(trunk_bytes)}; "
            f"experts {fmt_bytes(expert_total)} ({n_records} records of {fmt_bytes(record)}); "
            f"{active}"
        )
    ok = True
    if trunk_path.exists():
        status = "not verified"
        if verify:
            try:
                model.load_trunk(verify=True)
                status = "checksums ok"
            except Exception as exc:  # report, do not stop: other files still get checked
                status, ok = f"BAD: {exc}", False
        lines.append(f"file       {TRUNK_FILE}  {fmt_bytes(trunk_bytes)}  {status}")
    for shard in model.shards:
        status = f"{len(shard.records)} records, not verified"
        if verify:
            bad = shard.verify_all()
            ok &= not bad
            status = f"{len(shard.records)} records, " + (
                "checksums ok"
                if not bad
                else f"BAD checksums: {', '.join(f'layer {lay} expert {e}' for lay, e in bad[:5])}"
                + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
            )
        lines.append(
            f"file       {shard.path.name}  {fmt_bytes(shard.path.stat().st_size)}  {status}"
        )
    model.close()
    return "\n".join(lines), ok
