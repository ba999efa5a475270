"""The offline Engine: SGLang's `Engine` shape, scheduler in-process.

    with radixlm.Engine() as llm:                      # embedded SmolLM2 by default
        out = llm.generate("The capital of France is", {"max_new_tokens": 16})
        print(out["text"])

The call's input is normalized and validated by radixlm/request_input.py, as
the HTTP server's is; this module only drives the scheduler (in-process, or
through `RemoteScheduler` with tp/dp > 1).
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
from radixlm.request_input import GenerateInput, Limits, native_jobs, prompt_ids, prompt_inputs
from radixlm.runtime.detokenize import Detokenizer

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from radixlm.models.loader import load_config
        from radixlm.models.model_source import prepare_model_dir
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
        self._in_process = isinstance(self.scheduler, Scheduler)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.limits = Limits.of(self.scheduler)
        logger.info("KV cache: %d tokens; max running requests %d",
                    self.scheduler.max_total_tokens, self.scheduler.max_running_requests)

    # ---- public API ------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int | None = None, rid: str | list[str] | None = None,
                 session_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 priority: int | list[int] | None = None,
                 input_embeds: Any = None,
                 ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One input gives one dict (or, with n > 1, a list of n); a list of inputs
        gives a flat list (input-major, each result carrying its `index`,
        prompt i sample j -> i * n + j). `stream=True` returns an iterator of
        incremental chunks instead.
        `session_params` (one dict, or one per input): continue a session's earlier
        request, `{"id": sid, "rid": prev_rid, "offset": ..., "replace": ...}`; see
        radixlm/scheduler/session.py. A refused session request raises ValueError.
        `priority` (an integer, or one per input): higher runs first when the engine
        runs with enable_priority_scheduling.
        `input_embeds` instead of a prompt: one vector (the model's hidden size:
        what its embedding layer would give) per position, as nested lists, a
        tensor or an array; or a list of those, one per input. Such prompts share no
        cached KV (they have no token ids) and decode, sample and stream as any.
        Bad input raises ValueError naming the parameter (radixlm/request_input.py)."""
        if self.server_args.is_embedding:
            raise ValueError("this engine serves embeddings (is_embedding=True): use encode()")
        encode = self.tokenizer.encode if self.tokenizer is not None else None
        inputs, embeds, single = prompt_inputs(prompt, input_ids, _as_lists(input_embeds),
                                               encode, text_name="prompt")
        gid, jobs = native_jobs(inputs, sampling_params=sampling_params, rid=rid,
                                session_params=session_params, priority=priority,
                                input_embeds=embeds)
        call = GenerateInput(gid, jobs, stream=stream, return_logprob=return_logprob,
                             top_logprobs_num=top_logprobs_num,
                             logprob_start_len=-1 if logprob_start_len is None
                             else logprob_start_len)
        self.validate(call)
        if stream:
            return self._stream(call)
        results = self._run_to_completion(call)
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
        inputs, single = self._prompt_ids(prompt, input_ids)
        gid, jobs = native_jobs(inputs, sampling_params={"max_new_tokens": 0}, rid=rid)
        call = GenerateInput(gid, jobs)
        self.validate(call)
        results = [{"embedding": r["embedding"], "meta_info": r["meta_info"]}
                   for r in self._run_to_completion(call)]
        return results[0] if single else results

    def validate(self, call: GenerateInput) -> None:
        """The one validation of a call (request_input.GenerateInput.validate) against
        this engine's scheduler. In-process, grammars are compiled here (cached, so
        the scheduler finds them ready); through a RemoteScheduler only prechecked."""
        call.validate(self.limits, self.scheduler.grammars.validate, max_top_logprobs=None,
                      priority_scheduling=self.server_args.enable_priority_scheduling)

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
        _release_device_memory(self)


    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _control(self, method: str, **args: Any) -> Any:
        """Call a scheduler control method (see radixlm/scheduler/control.py)."""
        return self.scheduler.control(method, **args)

    def _prompt_ids(self, prompt: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
        encode = self.tokenizer.encode if self.tokenizer is not None else None
        return prompt_ids(prompt, input_ids, encode, text_name="prompt")

    # ---- running ----------------------------------------------------------------
    def _submit(self, call: GenerateInput) -> list[GenerateReq]:
        """Warm shared prompts (n > 1), then queue the call's requests; the call
        fails whole (e.g. a refused session request) and leaves nothing queued."""
        *warmups, reqs = call.stages(radix_cache=not self.server_args.disable_radix_cache)
        for stage in warmups:
            self._warm_up(stage)
        added = []
        try:
            for msg in reqs:
                self.scheduler.add_request(msg)
                added.append(msg.rid)
        except Exception:
            for rid in added:
                self.scheduler.abort(rid)
            raise
        return reqs

    def _warm_up(self, warmups: list[GenerateReq]) -> None:
        for msg in warmups:
            self.scheduler.add_request(msg)
        while any(m.rid in self.scheduler.reqs for m in warmups):
            self.scheduler.step()

    def _run_to_completion(self, call: GenerateInput) -> list[dict[str, Any]]:
        reqs = self._submit(call)
        seqs = {msg.rid: SeqOutput(msg.rid, i, return_logprob=msg.return_logprob)
                for i, msg in enumerate(reqs)}
        t0 = time.monotonic()
        while not all(seq.finished for seq in seqs.values()):
            if not self.scheduler.has_work:
                raise RuntimeError("scheduler went idle with requests unfinished")
            for out in self.detokenizer.process(self.scheduler.step()):
                seq = seqs.get(out.token.rid)
                if seq is not None:
                    seq.update(out)
        logger.debug("generated %d sequences in %.2fs", len(reqs), time.monotonic() - t0)
        self._check_when_idle()
        # The Python API keeps -inf logprobs (only JSON needs them finite).
        return [seqs[msg.rid].native(json_safe=False) for msg in reqs]

    def _stream(self, call: GenerateInput) -> Iterator[dict[str, Any]]:
        reqs = self._submit(call)
        index = {msg.rid: (i, msg.return_logprob) for i, msg in enumerate(reqs)}
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
            self._check_when_idle()

    def _check_when_idle(self) -> None:
        """The KV accounting invariant, once an in-process scheduler is idle (scheduler
        processes check their own, in a quiet moment of their loop)."""
        if self._in_process and not self.scheduler.has_work:
            self.scheduler.check_invariants()


def _as_lists(embeds: Any) -> Any:
    """A tensor or an array of embeddings as nested lists (what the wire checks)."""
    return embeds.tolist() if hasattr(embeds, "tolist") else embeds


class _ShutDown:
    """Stands for the scheduler of an engine that was shut down."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("this Engine was shut down; create a new one")


def _release_device_memory(engine: Engine) -> None:
    """Drop the engine's model and KV pools now, and hand cached CUDA blocks back:
    the next engine in this process sizes its KV cache from the free memory."""
    import gc

    engine.scheduler = _ShutDown()
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
