"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from chunkserve.engine.llm_engine import LLMEngine, StepError
from chunkserve.model.factory import LoadedModel
from chunkserve.outputs import RequestOutput
from chunkserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self, model: str = "smollm2-135m", loaded: LoadedModel | None = None,
        cost_model: str | None = None, **kwargs: Any
    ) -> None:
        """Offline runs keep the static throughput default (a budget of 2048).
        `chunk_policy="adaptive"` sizes chunks to `target_itl_ms` (default 250) with the
        engine's own step-time model, or `cost_model`'s (a profile file or a hardware preset)."""
        if kwargs.get("chunk_policy") == "adaptive" and kwargs.get("step_time") is None:
            # Imported here: the static default must not pay for the cost models' import.
            from chunkserve.sim.step_cost import engine_step_time

            kwargs["step_time"] = engine_step_time(cost_model, model)
        self.engine = LLMEngine.from_kwargs(loaded=loaded, model=model, **kwargs)

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs all prompts to completion together (continuous batching) in input order. A
        request that failed on its own comes back finished with finish_reason "error" and its
        `error` set; the others are unaffected."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("prompts and sampling_params must have the same length")

        # Only finished outputs are returned: the engine need not build one per token.
        params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(None, prompt, p))
        except ValueError:
            self.engine.abort_request(ids)  # all or nothing: no half-submitted batch
            raise
        results: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step().outputs
            except StepError as e:  # the step's requests end with the error; the rest go on
                outputs = self.engine.fail_step(e)
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], sampling_params)[0]


def _progress(total: int):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts")
