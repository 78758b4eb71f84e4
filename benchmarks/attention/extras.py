"""Attention candidates measured beside the production backends but not run by the service, behind the
op's signature `run(q, k, v, cu_seqlens, max_seqlen) -> [N, H, D]` (q, k, v [N, H, D] bf16 / fp16 on one
CUDA device, unit last stride, v possibly strided; cu_seqlens int32 [S + 1]; non-causal, scale D**-0.5).

    fa4_dense          flash_attn.cute.flash_attn_func on a [B, L, H, D] view (equal-length segments only)
    cudnn_fe           cudnn-frontend pygraph SDPA, ragged (THD) offsets + padding mask; graph cached per shape
    cudnn_fe_backend   the same graph, plan pinned to a cuDNN backend engine (no cudnn-frontend python engine)
    cudnn_fe_op        cudnn-frontend's own torch op torch.ops.cudnn.sdpa_fwd (its varlen path), a cross-check
    torch_sdpa_{flash,cudnn,efficient}
                       F.scaled_dot_product_attention on [B, H, L, D] views with one backend forced (equal
                       lengths only: B * max_seqlen == N, provable from ints, no filler slots)

Each has `available() -> str` ('' or why not); the dense-only ones serve a layout only when
`equal_lengths(n, slots, max_seqlen)` (candidates.py checks it). From reading the libraries' sources
(cudnn-frontend 1.32.0, flash-attn-4 4.0.0b36); the benchmark checks numerics, capture and the RNG for real.
"""

from __future__ import annotations

import importlib
import math
import threading

import torch
import torch.nn.functional as F

from encoder_service.ops import attention_fa4, cutlass_dsl


def equal_lengths(n: int, slots: int, max_seqlen: int) -> tuple[int, int] | None:
    """(B, L) when the layout is provably B segments of exactly L rows, from ints alone (each length <= L
    and they sum to N = B * L); zero-length filler slots make this None."""
    return (slots, max_seqlen) if slots >= 1 and max_seqlen >= 1 and slots * max_seqlen == n else None


class Candidate:
    name = "base"

    def available(self) -> str:
        return "" if torch.cuda.is_available() else "no CUDA"

    def run(self, q, k, v, cu_seqlens, max_seqlen):
        raise NotImplementedError

    def engine(self) -> str:
        return ""


class FA4Dense(Candidate):
    name = "fa4_dense"

    def available(self):
        if not torch.cuda.is_available():
            return "no CUDA"
        ok, why = attention_fa4.available(torch.device("cuda"))
        if not ok:
            return why
        from flash_attn.cute import flash_attn_func

        self._fn = flash_attn_func
        return ""

    def run(self, q, k, v, cu_seqlens, max_seqlen):
        b, length = equal_lengths(q.shape[0], cu_seqlens.numel() - 1, int(max_seqlen))
        out = self._fn(*(t.unflatten(0, (b, length)) for t in (q, k, v)), causal=False)  # [B, L, H, D] views
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.flatten(0, 1)


class TorchSDPADense(Candidate):
    def __init__(self, which: str):
        from torch.nn.attention import SDPBackend

        self.name = f"torch_sdpa_{which}"
        self._backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}[which]

    def run(self, q, k, v, cu_seqlens, max_seqlen):
        from torch.nn.attention import sdpa_kernel

        n, h, d = q.shape
        b, length = equal_lengths(n, cu_seqlens.numel() - 1, int(max_seqlen))
        args = [t.unflatten(0, (b, length)).transpose(1, 2) for t in (q, k, v)]  # [B, H, L, D] views
        with sdpa_kernel([self._backend]):
            out = F.scaled_dot_product_attention(*args)
        return out.transpose(1, 2).reshape(n, h, d)


class CudnnFrontend(Candidate):
    """cudnn-frontend 1.32 pygraph SDPA forward on packed THD tensors: the recipe of the library's own
    cudnn/sdpa/fwd/torch_op.py (_build_graph), without stats and without dropout (no RNG node):
    q/k/v described [B, H, S, D] with strides [S*row, head, row, 1] (the tensors' own: the strided v works),
    S = max_seqlen, ragged offsets int64 [B+1,1,1,1] = cu * row stride (element offsets, per tensor),
    seq_len_q/kv int32 [B,1,1,1], padding mask, o [B, H, S, D] packed + ragged offset. Built once per
    (dtype, B, H, S, D, strides) and cached; per call two tiny device ops (offsets, lengths), no host sync.
    The handle's stream is set to torch's current stream before every execute (capture stream)."""

    name = "cudnn_fe"
    backend_only = False
    _UID = dict(Q=1, K=2, V=3, SEQ_LEN_Q=5, SEQ_LEN_KV=6, RAGGED_Q=7, RAGGED_KV=8, RAGGED_O=9, RAGGED_V=11, O=100)

    def __init__(self):
        self._cudnn = None
        self._handles: dict[int, object] = {}
        self._graphs: dict[tuple, dict] = {}
        self._lock = threading.Lock()
        self._engine = ""

    def available(self):
        if not torch.cuda.is_available():
            return "no CUDA"
        try:
            cutlass_dsl.ensure_dsl_path()  # its python engines are CuTe DSL kernels too
            import cudnn  # after torch: libcudnn from site-packages/nvidia/cudnn/lib or already loaded

            self._cudnn = cudnn
            if cudnn.backend_version() < 90500:
                return f"cuDNN backend {cudnn.backend_version()} too old for ragged SDPA"
        except Exception as e:  # noqa: BLE001
            return f"import cudnn (nvidia-cudnn-frontend) failed: {type(e).__name__}: {str(e)[:200]}"
        return ""

    def engine(self):
        return self._engine

    def _handle(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        handle = self._handles.get(idx)
        if handle is None:
            with torch.cuda.device(idx):
                handle = self._handles[idx] = self._cudnn.create_handle()
        self._cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(idx).cuda_stream)
        return handle

    def _build(self, handle, dtype, b, h, s, d, q_stride, k_stride, v_stride, device):
        cudnn = self._cudnn
        io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
        uid = self._UID
        g = cudnn.pygraph(handle=handle, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)

        def desc(st):  # [B, H, S, D] of a packed [T, H, D] tensor with row stride st[0]
            return [s * st[0], st[1], st[0], st[2]]

        q_t = g.tensor(name="q", dim=[b, h, s, d], stride=desc(q_stride), data_type=io, uid=uid["Q"])
        k_t = g.tensor(name="k", dim=[b, h, s, d], stride=desc(k_stride), data_type=io, uid=uid["K"])
        v_t = g.tensor(name="v", dim=[b, h, s, d], stride=desc(v_stride), data_type=io, uid=uid["V"])
        i32, i64 = cudnn.data_type.INT32, cudnn.data_type.INT64
        one = [1, 1, 1, 1]
        sq = g.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=one, data_type=i32, uid=uid["SEQ_LEN_Q"])
        skv = g.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=one, data_type=i32, uid=uid["SEQ_LEN_KV"])
        ragged = {key: g.tensor(name=key.lower(), dim=[b + 1, 1, 1, 1], stride=one, data_type=i64, uid=uid[key])
                  for key in ("RAGGED_Q", "RAGGED_KV", "RAGGED_V", "RAGGED_O")}
        q_t.set_ragged_offset(ragged["RAGGED_Q"])
        k_t.set_ragged_offset(ragged["RAGGED_KV"])
        v_t.set_ragged_offset(ragged["RAGGED_V"])
        o_t, _ = g.sdpa(name="sdpa_fwd", q=q_t, k=k_t, v=v_t, generate_stats=False, attn_scale=1.0 / math.sqrt(d),
                        use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv,
                        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_left_bound=None,
                        diagonal_band_right_bound=None, sink_token=None)
        o_t.set_uid(uid["O"]).set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1])
        o_t.set_data_type(io).set_ragged_offset(ragged["RAGGED_O"])
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if self.backend_only:
            from cudnn.engines.engine_ids import is_python_engine

            index = next((i for i, p in enumerate(g.plans) if not is_python_engine(p.engine_id)), None)
            if index is None:
                raise RuntimeError("no cuDNN backend plan in the ranked list")
            g.select_plan(index)
        g.check_support()
        g.build_plans()
        engine = "cudnn-backend" if g.selected_engine is None else f"python:{g.selected_engine.name}"
        uids = (uid["Q"], uid["K"], uid["V"], uid["O"], uid["SEQ_LEN_Q"], uid["SEQ_LEN_KV"],
                uid["RAGGED_Q"], uid["RAGGED_O"], uid["RAGGED_KV"], uid["RAGGED_V"])
        # element row strides of q, o, k, v, in the order of the offset rows built per call
        strides = torch.tensor([q_stride[0], h * d, k_stride[0], v_stride[0]], dtype=torch.int64, device=device)
        workspace = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=device)
        return dict(graph=g, workspace=workspace, uids=uids, strides=strides, engine=engine)

    def run(self, q, k, v, cu_seqlens, max_seqlen):
        n, h, d = q.shape
        b, s = cu_seqlens.numel() - 1, int(max_seqlen)
        handle = self._handle(q.device)
        key = (q.dtype, b, h, s, d, q.stride(), k.stride(), v.stride(), q.device, self.backend_only)
        state = self._graphs.get(key)
        if state is None:
            with self._lock:
                state = self._graphs.setdefault(
                    key, self._build(handle, q.dtype, b, h, s, d, q.stride(), k.stride(), v.stride(), q.device))
        self._engine = state["engine"]
        pitch = (b + 2) // 2 * 2  # each offset row 16-byte aligned
        offsets = torch.empty((4, pitch), dtype=torch.int64, device=q.device)
        torch.mul(cu_seqlens.unsqueeze(0), state["strides"].unsqueeze(1), out=offsets[:, : b + 1])
        lpitch = (b + 3) // 4 * 4
        lengths = torch.empty((2, lpitch), dtype=torch.int32, device=q.device)
        torch.sub(cu_seqlens[1:].expand(2, b), cu_seqlens[:-1].expand(2, b), out=lengths[:, :b])
        seq_q, seq_kv = (lengths[i, :b].reshape(b, 1, 1, 1) for i in range(2))
        rag = [offsets[i, : b + 1].reshape(b + 1, 1, 1, 1) for i in range(4)]  # q, o, k, v
        out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
        buffers = [q, k, v, out, seq_q, seq_kv, rag[0], rag[1], rag[2], rag[3]]
        state["graph"].execute(buffers, state["workspace"], handle=handle, tensor_uids=state["uids"])
        return out


class CudnnFrontendBackendOnly(CudnnFrontend):
    name = "cudnn_fe_backend"
    backend_only = True


class CudnnFrontendOp(CudnnFrontend):
    """torch.ops.cudnn.sdpa_fwd(q, k, v, attn_scale, is_causal, causal_bottom_right, window_left,
    window_right, sinks, seq_len_q, seq_len_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
    return_lse) -> (o, stats), registered by importing cudnn.sdpa.fwd.torch_op; allocates its workspace and
    metadata per call. A cross-check of the hand-built graph above."""

    name = "cudnn_fe_op"

    def available(self):
        why = super().available()
        if why:
            return why
        try:
            importlib.import_module("cudnn.sdpa.fwd.torch_op")
            self._op = torch.ops.cudnn.sdpa_fwd
        except Exception as e:  # noqa: BLE001
            return f"cudnn.sdpa.fwd.torch_op: {type(e).__name__}: {str(e)[:200]}"
        return ""

    def run(self, q, k, v, cu_seqlens, max_seqlen):
        s = int(max_seqlen)
        out, _ = self._op(q, k, v, 1.0 / math.sqrt(q.shape[-1]), False, False, -1, -1, None, None, None,
                          cu_seqlens, cu_seqlens, s, s, False)
        return out


EXTRAS = {
    "fa4_dense": FA4Dense,
    "cudnn_fe": CudnnFrontend,
    "cudnn_fe_backend": CudnnFrontendBackendOnly,
    "cudnn_fe_op": CudnnFrontendOp,
    "torch_sdpa_flash": lambda: TorchSDPADense("flash"),
    "torch_sdpa_cudnn": lambda: TorchSDPADense("cudnn"),
    "torch_sdpa_efficient": lambda: TorchSDPADense("efficient"),
}
