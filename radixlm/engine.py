"""The offline Engine: SGLang's `Engine` shape, scheduler in-process.

    with radixlm.Engine() as llm:                      # embedded SmolLM2 by default
        out = llm.generate("The capital of France is", {"max_new_tokens": 16})
        print(out["text"])
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from radixlm.config import WEIGHT_UPDATE_GROUP, ServerArgs
from radixlm.outputs import SeqOutput
from radixlm.protocol import GenerateReq
from radixlm.runtime.detokenize import Detokenizer
from radixlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

NO_GRAMMAR = {"json_schema": None, "regex": None, "ebnf": None}  # prefill-only warm-ups


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from radixlm.models.loader import load_config, prepare_model_dir
        from radixlm.scheduler.scheduler import Scheduler
        from radixlm.tokenizer import get_tokenizer

        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        args = self.server_args
        model_dir = prepare_model_dir(args.model_path, args.load_format)
        self.tokenizer = None if args.skip_tokenizer_init else \
            get_tokenizer(args.tokenizer_path or model_dir)
        if args.tp_size > 1 or args.dp_size > 1:
            from radixlm.server.remote_scheduler import RemoteScheduler

            # Ranks are processes (as in the server), driven through a proxy.
            self.scheduler: Any = RemoteScheduler(args, model_dir)
        else:
            config = load_config(model_dir, args.context_length)
            self.scheduler = Scheduler(args, model_dir, config, self.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        logger.info("KV cache: %d tokens; max running requests %d",
                    self.scheduler.max_total_tokens, self.scheduler.max_running_requests)

    # ---- public API ------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int | None = None, rid: str | list[str] | None = None,
                 session_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One input gives one dict (or, with n > 1, a list of n); a list of inputs
        gives a flat list (input-major, each result carrying its `index`).
        `stream=True` returns an iterator of incremental chunks instead.
        `session_params` (one dict, or one per input): continue a session's earlier
        request, `{"id": sid, "rid": prev_rid, "offset": ..., "replace": ...}`; see
        radixlm/scheduler/session.py. A refused session request raises ValueError."""
        if self.server_args.is_embedding:
            raise ValueError("this engine serves embeddings (is_embedding=True): use encode()")
        inputs, single = self._normalize_inputs(prompt, input_ids)
        params = self._normalize_params(sampling_params, len(inputs))
        rids = self._normalize_rids(rid, len(inputs))
        sessions = _per_input(session_params, len(inputs), "session_params")
        reqs = self._build_requests(inputs, params, rids, stream, return_logprob,
                                    top_logprobs_num, logprob_start_len, sessions)
        if stream:
            return self._stream(reqs)
        results = self._run_to_completion(reqs)
        if single and len(results) == 1:
            return results[0]
        return results

    def encode(self, prompt: str | list[str] | None = None,
               input_ids: list[int] | list[list[int]] | None = None,
               rid: str | list[str] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """Embeddings (SGLang's Engine.encode; needs is_embedding=True): one input gives
        `{"embedding": [floats], "meta_info": {...}}`, a list of inputs a list of those.
        The vector is the pooled (--embedding-pooling) final hidden state, L2-normalized."""
        if not self.server_args.is_embedding:
            raise ValueError("encode() needs an embedding engine: Engine(is_embedding=True)")
        inputs, single = self._normalize_inputs(prompt, input_ids)
        rids = self._normalize_rids(rid, len(inputs))
        reqs = []
        for i, (ids, r) in enumerate(zip(inputs, rids, strict=True)):
            self.scheduler.validate_input(ids, 0)
            reqs.append((i, 0, GenerateReq(rid=r, input_ids=ids,
                                           sampling_params={"max_new_tokens": 0})))
        results = [{"embedding": r["embedding"], "meta_info": r["meta_info"]}
                   for r in self._run_to_completion(reqs)]
        return results[0] if single else results

    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """Open a session (SGLang's API) and return its id; ValueError if refused (an id
        already open, a negative capacity, ...). Capacity: the most tokens a request of
        the session may take as input, 0 for no limit."""
        result = self._control("open_session", capacity_of_str_len=capacity_of_str_len,
                               session_id=session_id or uuid.uuid4().hex)
        if not result["success"]:
            raise ValueError(result["message"])
        return result["session_id"]

    def close_session(self, session_id: str) -> None:
        """Close a session; ValueError if it is not open. Its running requests finish."""
        result = self._control("close_session", session_id=session_id)
        if not result["success"]:
            raise ValueError(result["message"])

    def get_server_info(self) -> dict[str, Any]:
        return {**self._control("get_server_info"), "server_args": self.server_args.__dict__}

    def flush_cache(self) -> tuple[bool, str]:
        result = self._control("flush_cache")
        return result["success"], result["message"]

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._control("abort", rid=rid, abort_all=abort_all)

    # ---- runtime control: weights, memory, profiling (scheduler/control.py) ----
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False) -> tuple[bool, str]:
        """Load a checkpoint (HF directory or .gguf) into the live model. All or nothing:
        on any failure the old weights stay and the answer is (False, reason). Refused
        while requests are live unless `abort_all_requests`. Flushes the prefix cache."""
        ok, message = self._result("update_weights_from_disk", model_path=model_path,
                                   load_format=load_format,
                                   abort_all_requests=abort_all_requests)
        if ok:
            self.server_args = self.server_args.replace(model_path=model_path,
                                                        load_format=load_format or "auto")
        return ok, message

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]],
                                   load_format: str | None = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False) -> tuple[bool, str]:
        """Load whole HF-named tensors (any subset of the model); they travel to the
        scheduler as safetensors bytes. (False, reason) for a bad name, dtype or shape."""
        from radixlm.runtime.weight_updater import serialize_named_tensors

        try:
            data = serialize_named_tensors(named_tensors)
        except (TypeError, ValueError) as e:
            return False, str(e)
        return self._result("update_weights_from_tensor", serialized_named_tensors=data,
                            load_format=load_format, flush_cache=flush_cache,
                            abort_all_requests=abort_all_requests)

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = WEIGHT_UPDATE_GROUP,
                                  backend: str | None = None) -> tuple[bool, str]:
        """Join a trainer's weight-sync group (the trainer is rank 0 and runs
        `weight_updater.new_weight_sync_group(..., rank=0)`); blocks until all joined."""
        return self._result("init_weights_update_group", master_address=master_address,
                            master_port=master_port, rank_offset=rank_offset,
                            world_size=world_size, group_name=group_name, backend=backend)

    def destroy_weights_update_group(self, group_name: str = WEIGHT_UPDATE_GROUP
                                     ) -> tuple[bool, str]:
        return self._result("destroy_weights_update_group", group_name=group_name)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any],
                                        shapes: list[list[int]],
                                        group_name: str = WEIGHT_UPDATE_GROUP,
                                        flush_cache: bool = True,
                                        abort_all_requests: bool = False) -> tuple[bool, str]:
        """Receive `names` by broadcast from the trainer (in order) and load them."""
        return self._result("update_weights_from_distributed", names=list(names),
                            dtypes=[str(d).removeprefix("torch.") for d in dtypes],
                            shapes=[[int(x) for x in s] for s in shapes],
                            group_name=group_name, flush_cache=flush_cache,
                            abort_all_requests=abort_all_requests)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of the flattened HF-named parameter (the
        whole tensor's under tensor parallelism); ValueError for an unknown name."""
        result = self._control("get_weights_by_name", name=name, truncate_size=truncate_size)
        if not result["success"]:
            raise ValueError(result["message"])
        return result["values"]

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Free the KV cache and/or weights (tags "kv_cache", "weights"; None: both);
        generate() raises ValueError until resume_memory_occupation."""
        return self._result("release_memory_occupation", tags=tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        return self._result("resume_memory_occupation", tags=tags)

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                      activities: list[str] | None = None, with_stack: bool | None = None,
                      record_shapes: bool | None = None) -> tuple[bool, str]:
        """torch.profiler over the scheduler; the trace goes to `output_dir` (default:
        $RADIXLM_TORCH_PROFILER_DIR or a temp dir) at stop_profile or after num_steps."""
        return self._result("start_profile", output_dir=output_dir, num_steps=num_steps,
                            activities=activities, with_stack=with_stack,
                            record_shapes=record_shapes, profile_id=str(time.time()))

    def stop_profile(self) -> tuple[bool, str]:
        return self._result("stop_profile")

    def configure_logging(self, log_level: str | None = None) -> tuple[bool, str]:
        """Set the level of the `radixlm` loggers ("debug", "info", ...)."""
        return self._result("configure_logging", log_level=log_level)

    def _result(self, method: str, **args: Any) -> tuple[bool, str]:
        result = self._control(method, **args)
        return result["success"], result["message"]

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.scheduler.abort(abort_all=True)
        self.scheduler.step()
        if hasattr(self.scheduler, "shutdown"):
            self.scheduler.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _control(self, method: str, **args: Any) -> Any:
        """Call a scheduler control method (see radixlm/scheduler/control.py)."""
        return self.scheduler.control(method, **args)

    # ---- input normalization ------------------------------------------------------
    def _normalize_inputs(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init is set: pass input_ids, not prompt")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            return [self.tokenizer.encode(t) for t in texts], single
        single = not input_ids or not isinstance(input_ids[0], list)
        ids = [input_ids] if single else input_ids
        if not all(isinstance(t, int) and not isinstance(t, bool) for x in ids for t in x):
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
        return [list(x) for x in ids], single

    @staticmethod
    def _normalize_params(sp, n: int) -> list[SamplingParams]:
        if not isinstance(sp, list):
            return [SamplingParams.from_dict(sp)] * n
        return [SamplingParams.from_dict(p) for p in _per_input(sp, n, "sampling_params")]

    @staticmethod
    def _normalize_rids(rid, n: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        rids = [rid] if isinstance(rid, str) else list(rid)
        if len(rids) != n:
            raise ValueError(f"got {len(rids)} rids for {n} inputs")
        return rids

    def _build_requests(self, inputs, params, rids, stream, return_logprob, top_logprobs_num,
                        logprob_start_len, sessions) -> list[tuple[int, int, GenerateReq]]:
        if top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
        reqs = []
        for i, (ids, p, rid, session) in enumerate(zip(inputs, params, rids, sessions)):
            self.scheduler.validate_input(ids, p.max_new_tokens)
            p.validate(self.scheduler.vocab_size)
            self.scheduler.grammars.validate(p)  # compiles (cached): errors name the grammar
            for j in range(p.n):
                sub_rid = rid if p.n == 1 else f"{rid}-{j}"
                sp = p.to_dict()
                if p.seed is not None and j:
                    sp["seed"] = p.seed + j  # n samples of one seeded request must differ
                reqs.append((i, j, GenerateReq(
                    rid=sub_rid, input_ids=ids, sampling_params=sp, stream=stream,
                    return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                    logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                    session_params=session)))
        return reqs

    # ---- running ----------------------------------------------------------------
    def _submit(self, reqs: list[tuple[int, int, GenerateReq]]) -> None:
        self._warm_shared_prompts(reqs)
        added = []
        try:
            for _, _, msg in reqs:
                self.scheduler.add_request(msg)
                added.append(msg.rid)
        except Exception:  # e.g. a refused session request: the call fails whole
            for rid in added:
                self.scheduler.abort(rid)
            raise

    def _warm_shared_prompts(self, reqs: list[tuple[int, int, GenerateReq]]) -> None:
        """n > 1: prefill the prompt once so the n samples share its KV (seed 000)."""
        if self.server_args.disable_radix_cache:
            return
        warm = {}
        for i, j, msg in reqs:
            if j == 1 and msg.session_params is None:  # a session's prompt is built later
                warm[i] = GenerateReq(rid=f"warm-{uuid.uuid4().hex}", input_ids=msg.input_ids,
                                      sampling_params={**msg.sampling_params,
                                                       "max_new_tokens": 0, "n": 1,
                                                       **NO_GRAMMAR})
        for msg in warm.values():
            self.scheduler.add_request(msg)
        while any(m.rid in self.scheduler.reqs for m in warm.values()):
            self.scheduler.step()

    def _run_to_completion(self, reqs) -> list[dict[str, Any]]:
        self._submit(reqs)
        seqs = {msg.rid: SeqOutput(msg.rid, j, return_logprob=msg.return_logprob)
                for _, j, msg in reqs}
        t0 = time.monotonic()
        while not all(seq.finished for seq in seqs.values()):
            if not self.scheduler.has_work:
                raise RuntimeError("scheduler went idle with requests unfinished")
            for out in self.detokenizer.process(self.scheduler.step()):
                seq = seqs.get(out.token.rid)
                if seq is not None:
                    seq.update(out)
        logger.debug("generated %d sequences in %.2fs", len(reqs), time.monotonic() - t0)
        # The Python API keeps -inf logprobs (only JSON needs them finite).
        return [seqs[msg.rid].native(json_safe=False) for _, _, msg in reqs]

    def _stream(self, reqs) -> Iterator[dict[str, Any]]:
        self._submit(reqs)
        index = {msg.rid: (j, msg.return_logprob) for _, j, msg in reqs}
        pending = set(index)
        try:
            while pending:
                for out in self.detokenizer.process(self.scheduler.step()):
                    rid = out.token.rid
                    if rid not in index:
                        continue
                    if out.token.finish_reason is not None:
                        pending.discard(rid)
                    # A chunk is this message alone: the new text, ids and logprobs.
                    chunk = SeqOutput(rid, index[rid][0], return_logprob=index[rid][1])
                    chunk.update(out)
                    yield chunk.native(json_safe=False)
        finally:
            for rid in pending:  # the caller stopped iterating: free their KV
                self.scheduler.abort(rid)
            if pending:
                self.scheduler.step()

def _per_input(value: Any, n: int, name: str) -> list[Any]:
    """One value per input: a list must have n entries, anything else is shared."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"got {len(value)} {name} for {n} inputs")
        return value
    return [value] * n
