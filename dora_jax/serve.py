"""Serve a run's policy with JetStream's own server: its orchestrator drives our Engine.

    python -m dora_jax.serve --config=configs/quickstart.py --workdir=/tmp/qs \\
        --prompt="Calculate 7 - 3." --prompt="Calculate 12 + 5."
    python -m dora_jax.serve --config=configs/quickstart.py --workdir=/tmp/qs --port=9000

With `--prompt` the prompts go through JetStream's `LLMOrchestrator.Decode` in this
process, all at once, each rendered as a user turn with the tokenizer's chat template
and the config's task instruction, as training saw them (`--raw`: the text as given);
each answer prints as it came back. With `--port` JetStream's gRPC server answers
`Decode` requests (JetStream's clients and load-test benchmarks) until interrupted.

The params: the newest checkpoint of the run in `--workdir` (the same config and
overrides as the run), LoRA adapters folded into the weights; without `--workdir`, what
the config starts from (`model.checkpoint`, e.g. an exported Hugging Face checkpoint, or
`init_checkpoint`). One Engine on decode slice 0's devices serves prefill and generate
(JetStream's interleaved mode), `--slots` requests at a time. JetStream's server indexes
its padding buckets with the prompt length, so `rollout.max_prefill_length` is raised to
the next of them where it is not one. Needs JetStream and its server's dependencies
(docs/rollout.md, "Serving with JetStream's server").
"""

from __future__ import annotations

import dataclasses

from dora_jax.config import Config

# JetStream's token_utils.DEFAULT_PREFILL_BUCKETS, which its server pads prompts to.
JETSTREAM_BUCKETS = tuple(2 ** i for i in range(4, 16))


def missing_modules() -> list:
    """What serving imports and this environment lacks (JetStream's server's modules)."""
    import importlib.util

    return [m for m in ("jetstream", "grpc", "prometheus_client", "shortuuid", "seqio",
                        "transformers") if importlib.util.find_spec(m) is None]


def serving_rollout(cfg: Config, *, slots: int, max_tokens: int):
    """The run's rollout settings for serving: `slots` at once, responses up to
    `max_tokens`, the longest prompt one of JetStream's buckets."""
    r = cfg.rollout
    if not 0 < max_tokens <= r.max_decode_len:
        # The engine ends a sequence at max_decode_len; JetStream would then append a
        # token of the idle slot's row (docs/rollout.md).
        raise ValueError(f"--max_tokens={max_tokens}: between 1 and "
                         f"rollout.max_decode_len ({r.max_decode_len})")
    longest = next((b for b in JETSTREAM_BUCKETS if b >= r.max_prefill_length), None)
    if longest is None:
        raise ValueError(f"rollout.max_prefill_length {r.max_prefill_length} is beyond "
                         f"JetStream's largest padding bucket ({JETSTREAM_BUCKETS[-1]})")
    buckets = tuple(sorted({*r.prefill_buckets, longest}))
    return dataclasses.replace(r, slots_per_slice=slots, max_prefill_length=longest,
                               prefill_buckets=buckets, kv_pages=0)


def served_params(cfg: Config, workdir: str | None, trainer_mesh):
    """(step or None, params without adapters, their model config): the newest
    checkpoint of the run in `workdir`, else what the config starts from."""
    from dora_jax.model import lora

    if workdir:
        from dora_jax.export import newest_params

        step, params = newest_params(cfg, workdir, trainer_mesh)
    else:
        from dora_jax.runtime.experiment import initial_params

        step, params = None, initial_params(cfg, trainer_mesh)[1]
    if cfg.model.lora.enabled:
        return step, lora.merged_weights(params, cfg.model.lora), lora.base_config(cfg.model)
    return step, params, cfg.model


def build(cfg: Config, workdir: str | None, tokenizer, *, slots: int, max_tokens: int,
          temperature: float = 0.0):
    """(Engine, its placed params, step): the policy on decode slice 0's mesh, its
    stop ids the run's (`tokenizer`: the run's, or None); temperature 0 decodes
    greedily."""
    from dora_jax.config import devices
    from dora_jax.rollout import Engine, SamplingParams
    from dora_jax.rollout.sampling import read_stop_ids

    trainer_mesh, slice_meshes = devices.make_meshes(cfg.mesh)
    step, params, model_cfg = served_params(cfg, workdir, trainer_mesh)
    rollout = serving_rollout(cfg, slots=slots, max_tokens=max_tokens)
    sampling = (SamplingParams(greedy=True) if temperature == 0
                else SamplingParams(temperature, rollout.top_k, rollout.top_p))
    engine = Engine(model_cfg, rollout, slice_meshes[0], rules=cfg.mesh.decode_rules,
                    sampling_params=sampling, tokenizer_path=cfg.data.tokenizer or None,
                    stop_ids=read_stop_ids(rollout, tokenizer))
    return engine, engine.load_params(params), step


def prompt_tokens(cfg: Config, tokenizer, texts, *, raw: bool,
                  max_length: int) -> list[list[int]]:
    """Each text as the model's prompt: a chat user turn with the task's instruction
    and the config's chat-template arguments (as training built them), or with `raw`
    the text's own tokens. ValueError, naming the prompt, if one is longer than
    `max_length` tokens."""
    from dora_jax.data.text_records import DEFAULT_INSTRUCTIONS, chat_tokens
    from dora_jax.tasks.base import chat_tokenizer, text_options

    if tokenizer is None:
        raise ValueError("serving text needs the run's tokenizer (data.tokenizer)")
    if raw or tokenizer.chat_template is None:
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        options = text_options(cfg)
        instruction = options["instruction"]
        if instruction is None:
            instruction = DEFAULT_INSTRUCTIONS.get(cfg.data.source, "")
        chat = chat_tokenizer(cfg, tokenizer)
        prompts = [chat_tokens(chat, t, instruction=instruction,
                               system_prompt=options["system_prompt"]) for t in texts]
    for text, ids in zip(texts, prompts):
        if len(ids) > max_length:
            raise ValueError(f"--prompt={text[:60]!r}: {len(ids)} tokens, more than the "
                             f"{max_length} a prompt may have (rollout.max_prefill_length "
                             f"raised to JetStream's bucket)")
    return prompts


def driver_for(engine, params):
    """JetStream's orchestrator Driver serving `engine` in interleaved mode."""
    from jetstream.core import orchestrator

    return orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)


def answer(driver, prompts, *, max_tokens: int, timeout_s: float = 600.0) -> list[list]:
    """Sends every prompt (token ids) at once through JetStream's LLMOrchestrator in
    this process; returns each one's response token ids, in order (JetStream streams
    no text for token requests)."""
    import asyncio

    from jetstream.core import orchestrator
    from jetstream.core.proto import jetstream_pb2 as pb

    client = orchestrator.LLMOrchestrator(driver=driver)

    async def one(ids):
        # has_bos: the prompt is the model's input as it is (JetStream adds none).
        req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=ids),
                               has_bos=True, max_tokens=max_tokens)
        out: list = []
        async for resp in client.Decode(req):
            for got in resp.stream_content.samples:
                out.extend(got.token_ids)
        return out

    async def every():
        return await asyncio.wait_for(asyncio.gather(*(one(list(p)) for p in prompts)),
                                      timeout_s)

    # JetStream's return channels still schedule work on the loop after the last
    # response: it stays open until the driver has stopped (the caller's job).
    loop = asyncio.new_event_loop()
    return loop.run_until_complete(every())


def serve_port(driver, port: int, threads: int):
    """JetStream's gRPC server for `driver` on `port`, started."""
    import grpc
    from jetstream.core import server_lib

    server = server_lib.JetStreamServer(driver, threads, port,
                                        grpc.insecure_server_credentials())
    server.start()
    return server


if __name__ == "__main__":
    import json

    from absl import app, flags, logging

    from dora_jax.runtime import cli
    from dora_jax.tasks import sources

    _CONFIG = cli.define_config_flag()
    _WORKDIR = flags.DEFINE_string("workdir", None, "the run whose newest checkpoint to "
                                   "serve (default: the config's own starting params)")
    _PROMPT = flags.DEFINE_multi_string("prompt", [], "a prompt to answer (repeatable)")
    _RAW = flags.DEFINE_bool("raw", False, "send prompts as given, without the chat template")
    _PORT = flags.DEFINE_integer("port", None, "serve JetStream's gRPC API on this port")
    _SLOTS = flags.DEFINE_integer("slots", 8, "requests decoded at once")
    _MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "response tokens per request "
                                       "(default: rollout.max_decode_len)")
    _TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy")
    _JSON = flags.DEFINE_bool("json", False, "print each answer as a JSON line: "
                              "prompt, response ids and text")

    def main(argv):
        del argv
        logging.set_verbosity(logging.WARNING)
        if not _PROMPT.value and _PORT.value is None:
            raise SystemExit("error: give --prompt=TEXT (repeatable) or --port=PORT")
        missing = missing_modules()
        if missing:
            raise SystemExit(f"error: serving needs {', '.join(missing)}: pip install -e "
                             f"'.[jetstream]', and JetStream's checkout on PYTHONPATH "
                             f"(docs/rollout.md)")
        cfg = cli.validated_config(_CONFIG)
        if _WORKDIR.value:
            cli.workdir_to_read(_WORKDIR.value)
        max_tokens = _MAX_TOKENS.value or cfg.rollout.max_decode_len
        cli.start_devices(cfg)
        with cli.one_line_errors():
            tokenizer = sources.tokenizer_for(cfg)
            # Before any compute: a prompt too long is named now.
            longest = serving_rollout(cfg, slots=_SLOTS.value,
                                      max_tokens=max_tokens).max_prefill_length
            prompts = (prompt_tokens(cfg, tokenizer, _PROMPT.value, raw=_RAW.value,
                                     max_length=longest) if _PROMPT.value else [])
            engine, params, step = build(cfg, _WORKDIR.value, tokenizer, slots=_SLOTS.value,
                                         max_tokens=max_tokens,
                                         temperature=_TEMPERATURE.value)
        where = f"step {step} of {_WORKDIR.value}" if step is not None else "initial params"
        print(f"serving {where} with JetStream's orchestrator, {_SLOTS.value} slots",
              flush=True)
        driver = driver_for(engine, params)
        if prompts:
            try:
                got = answer(driver, prompts, max_tokens=max_tokens)
            except BaseException:
                driver.stop()
                raise
            if _PORT.value is None:
                driver.stop()
            for text, ids in zip(_PROMPT.value, got):
                shown = tokenizer.decode(ids, skip_special_tokens=True)
                print(json.dumps({"prompt": text, "ids": ids, "text": shown})
                      if _JSON.value else f"> {text}\n{shown}", flush=True)
        if _PORT.value is not None:
            server = serve_port(driver, _PORT.value, threads=max(64, _SLOTS.value))
            print(f"listening on port {_PORT.value}", flush=True)
            try:
                server.wait_for_termination()  # stops the server and the driver
            except KeyboardInterrupt:
                print("stopped", flush=True)

    app.run(main, flags_parser=cli.parse_flags)
