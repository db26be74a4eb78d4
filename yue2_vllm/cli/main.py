"""The parser of every command and `main` (signals, the status line of an error); each command lives in its
own module (`generate`, `batch`, `doctor`, `tools`), `setup` holds what they share."""
from __future__ import annotations

import argparse
import signal
import sys

from ..hub import DEFAULT_MODEL
from ..kv_cache import FORMS as KV_FORMS
from ..options import CFG_ENGINES, DTYPES, FLAT_BACKENDS, QUANTIZATIONS, QUANTIZED_POLICIES, RUNNERS
from ..request_json import error_type
from ..serve.disk import RETENTION_SECONDS
from ..startup import ENGINE_START_TIMEOUT_S
from .batch import cmd_batch
from .doctor import cmd_doctor
from .generate import cmd_generate
from .setup import _interrupt, _signal_name, print_status
from .transcribe import add_knob_flags, cmd_transcribe
from .tools import cmd_calibrate, cmd_derive, cmd_evaluate, cmd_make_tiny, cmd_quantize, cmd_serve

DESCRIPTION = """`yue2-vllm`: generate songs, run batches, check the installation, write tiny checkpoints.

Progress goes to stderr; stdout carries one JSON status line per song (or per command).
"""


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, when it has one worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _positive(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of {unit}, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _positive(text, "GiB")


def _positive_seconds(text: str) -> float:
    return _positive(text, "seconds")


def _retention(text: str) -> float | None:
    """Seconds, or `forever` (None: finished jobs are never purged)."""
    if text == "forever":
        return None
    try:
        return _positive_seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds or 'forever', got {text}") from None


def _integer_in(text: str, low: int, high: int | None, words: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
    return value


def _count(text: str) -> int:
    """A flag that counts something (songs, rows, tokens, jobs): an integer >= 1."""
    return _integer_in(text, 1, None, "an integer >= 1")


def _port(text: str) -> int:
    return _integer_in(text, 0, 65535, "a port in 0-65535 (0: any free port)")


MODEL_HELP = ("YuE2 MoT: a directory (config.json, model.safetensors, qwen.tiktoken) or a Hugging Face repo id "
              "(downloaded into $HF_HOME; HF_HUB_OFFLINE=1 uses the cache only); default: m-a-p/YuE2-3B once --vae "
              "is given, else the embedded tiny model (with its tiny VAE)")
VAE_HELP = ("YuE2 VAE: standard (m-a-p/YuE2-Vae, for listening), legacy (m-a-p/YuE2-Vae-legacy, upstream's paper "
            "evaluation), a directory or a repo id; default: standard once --model is given, else the embedded "
            "tiny VAE")


def _model_flags(parser: argparse.ArgumentParser, runs: bool = True) -> None:
    """The flags that build a pipeline; `runs`: also --output / --resume (the commands that write runs)."""
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--vae", help=VAE_HELP)
    parser.add_argument("--revision", help="--model's Hub revision: a branch, tag or commit (default: main)")
    parser.add_argument("--vae-revision", help="--vae's Hub revision (default: main)")
    parser.add_argument("--device", default="auto", help="torch device: auto (CUDA if available, else CPU), cpu, "
                                                         "cuda, cuda:N or mps")
    parser.add_argument("--budget", type=_positive_float, default=None,
                        help="memory budget in GiB (the vLLM engine must fit it; <= 12 decodes smaller VAE tiles); "
                             "default: a discrete GPU's memory less 10 %%, on unified memory (DGX Spark) MemAvailable "
                             "less the OS reserve, on the CPU 24 or the machine's memory less 10 %%, the lesser; "
                             "above the card is refused")
    parser.add_argument("--backend", choices=FLAT_BACKENDS,
                        help="AR backend: torch, or vllm/auto (vLLM whenever it is installed and can serve the "
                             "phase, else torch, shown on screen and recorded); torch-eager (upstream's) is torch "
                             "with --torch-execution eager; default: auto, but torch for the embedded tiny model, "
                             "whose short songs finish on torch before a vLLM engine starts")
    parser.add_argument("--ar-checkpoint", help="serve the AR half from this Qwen3 checkpoint (e.g. an FP8/int8 "
                                                 "export) instead of deriving one; default: $YUE2_AR_CHECKPOINT, "
                                                 "else derived")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                        help="torch AR path: int8/fp8 load-time proxies (restored before the NAR); a yue2-int8-ar "
                             "checkpoint needs auto or int8")
    parser.add_argument("--offload-ar", action="store_true",
                        help="move the AR expert off the accelerator during the NAR's ODE steps, for 16-24 GB "
                             "cards (default: off)")
    parser.add_argument("--offload-nar", action="store_true",
                        help="upstream's later flag: turns --offload-ar on, as its offload_ar = offload_ar or "
                             "offload_nar (where the NAR's weights sit is ours); default: off, as upstream's CLI "
                             "before it (the version that adds it has it on)")
    parser.add_argument("--no-offload-nar", dest="offload_nar", action="store_false", default=False,
                        help="upstream's: --offload-nar off (this CLI's default)")
    parser.add_argument("--quantized-policy", choices=QUANTIZED_POLICIES, default="auto",
                        help="a quantized --ar-checkpoint without a kernel faster than bf16 on this device is served "
                             "as the bf16 derived checkpoint, on the record (auto), or anyway (force); default: auto")
    parser.add_argument("--no-sliced-head", action="store_true",
                        help="compute the full 184,704-row lm_head on vLLM (default: only the rows the phase allows; "
                             "the V1 runner only)")
    parser.add_argument("--reproducible", action="store_true",
                        help="a seed fixes the song whatever else the engine serves: vLLM's batch-invariant kernels "
                             "on CUDA sm80+, else a float32 engine (slower; result.json records batch_invariant). "
                             "Default: off (bf16 tokens on vLLM may depend on the songs sharing a step)")
    parser.add_argument("--vllm-runner", choices=RUNNERS, default="auto",
                        help="vLLM's model runner for our engine: v2 (Model Runner V2, async scheduling on CUDA), v1, "
                             "or auto = what vLLM would choose (v2 on CUDA with vLLM >= 0.31, v1 on CPU); recorded "
                             "per song (default: auto)")
    parser.add_argument("--torch-execution", choices=("auto", "graph", "eager"), default="auto",
                        help="how the torch AR backend decodes: graph (both CFG branches as one batch, one captured "
                             "CUDA graph step per token; CUDA only), eager (one forward per branch and token), or "
                             "auto = graph on CUDA, eager on CPU/MPS; a failed capture decodes that phase eagerly. "
                             "Recorded per phase (execution, attention, graph_fallback_reason). Default: auto")
    parser.add_argument("--cfg-engine", choices=CFG_ENGINES, default="vllm",
                        help="where songs with cfg_scale != 1 (cot=off included) run when --backend is vllm/auto: as "
                             "paired rows on the engine, or on the torch backend (default: vllm)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="AR numerics of both backends (default bfloat16; float32 for verification runs: bf16 "
                             "decoding on vLLM-CPU depends on the batch)")
    parser.add_argument("--kv-cache-dtype", choices=KV_FORMS, default="auto",
                        help="the vLLM engine's KV cache: auto (the model dtype) or an FP8 form (fp8 = fp8_e4m3, "
                             "fp8_e5m2): one byte an element, twice the rows; CUDA sm80+ and AVX-512/AMX CPUs, "
                             "refused elsewhere; recorded per song. Default: auto (docs/kv-cache.md)")
    parser.add_argument("--max-num-seqs", type=_count, help="vLLM engine rows (default: --concurrency, else sized "
                                                          "from --budget)")
    parser.add_argument("--max-num-batched-tokens", type=_count,
                        help="vLLM tokens per engine step; longer prompts are prefilled in chunks (default 2048)")
    parser.add_argument("--engine-start-timeout", type=_positive_seconds, metavar="SECONDS",
                        help=f"give up a vLLM engine start after this long (songs then run on the torch backend, on "
                             f"the record, and the start is tried again 60 s later, then 120 s, ... up to 30 min "
                             f"apart); default {ENGINE_START_TIMEOUT_S:.0f}: a cold first start of the real weights on "
                             f"a DGX Spark (see docs/dgx-spark.md)")
    parser.add_argument("--config", help="generation config JSON: abc / semantic (or abc_sampling / "
                                          "semantic_sampling, as in request files) objects of sampling fields, and "
                                          "ode_steps; default: upstream's (the tiny model's budgets without --model "
                                          "or --vae)")
    parser.add_argument("--verify-hashes", action="store_true", help="re-hash the weights instead of trusting "
                                                                      "the size+mtime cache")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                        help="adapters to serve by name (vLLM's convention: name=path, a Hub repo id as the path, or "
                             "JSON {\"name\", \"path\"}); requests pick them by name with a scale. Read, checked "
                             "and converted before anything loads (docs/adapters.md)")
    parser.add_argument("--max-loras", type=_count, help="vLLM LoRA slots: distinct AR adapters in one engine step "
                                                         "(default: the AR adapters registered, at most 4)")
    parser.add_argument("--max-lora-rank", type=_count,
                        help="the largest AR adapter rank the engine takes (default: what the registered ones need, "
                             "as vLLM's choices 8, 16, 32, 64, ... round it)")
    parser.add_argument("--instrumental-adapter", metavar="NAME",
                        help="a registered AR adapter that instrumental songs run with, as its card prescribes, "
                             "instead of upstream's plan-edit-render recipe (docs/instrumental.md)")
    if runs:
        parser.add_argument("--lora", action="append", default=None, metavar="PATH_OR_HUB_ID[:SCALE]",
                            help="an adapter every song of this run uses (repeatable; a file, a directory or a Hub "
                                 "repo id, optionally /sub/path; SCALE default 1); batch rows with their own "
                                 "'adapters' use those")
        parser.add_argument("--output", default="runs", help="songs go to OUTPUT/<id>")
        parser.add_argument("--resume", action="store_true", help="continue a run from its last verified stage")
    parser.add_argument("--quiet", "--no-progress", action="store_true",
                        help="no progress bars or notes on stderr (--no-progress: upstream's name)")


def _replica_gpus(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 <= value <= 8) or (value > 1 and value != int(value)):
        raise argparse.ArgumentTypeError(f"must be 0 (CPU replicas), a fraction of one GPU or whole GPUs, got {text}")
    return value


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Scale-out on Ray Serve (the `ray` extra): a song worker replica per GPU behind this server's API."""
    parser.add_argument("--replicas", type=_count, metavar="N",
                        help="serve from N song-worker replicas (each a pipeline, its engine and synthesis lane) on a "
                             "local Ray cluster this command starts; with --ray-address, on that cluster (default "
                             "there: one per GPU). Without either flag: one process, no Ray")
    parser.add_argument("--ray-address", metavar="ADDR",
                        help="join this Ray cluster (HOST:6379 of `ray start --head`, or auto) instead of starting one; "
                             "the data dir must be shared by every node")
    parser.add_argument("--replica-gpus", type=_replica_gpus, metavar="G",
                        help="GPUs each replica reserves (default: 1 where the cluster has GPUs, else 0 = CPU "
                             "replicas; a fraction puts several replicas, each with its own engine, on one GPU)")
    parser.add_argument("--replica-cpus", type=_count, metavar="C",
                        help="CPU cores each replica reserves (default: 1 beside a GPU; on a CPU cluster its cores "
                             "shared out, each replica pinned to its own)")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="yue2-vllm", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter, **kwargs)

    generate = command("generate", "generate one song")
    _model_flags(generate)
    generate.add_argument("--request", help="request JSON (style/tags, lyrics, cot, seed, abc or abc_path, cfg_scale, "
                                            "id, abc_sampling, semantic_sampling, seconds, instrumental, "
                                            "melody_audio and melody); flags override its fields")
    generate.add_argument("--style", help="style tags, e.g. 'pop, piano, female vocal' (default: the request's)")
    generate.add_argument("--lyrics", help="lyrics text with [verse]/[chorus] sections (default: the request's)")
    generate.add_argument("--lyrics-file", help="read the lyrics from this UTF-8 file")
    generate.add_argument("--abc-file", help="external ABC score (cot melody/full), read byte for byte: skips the "
                                             "score phase")
    generate.add_argument("--melody-audio", metavar="FILE",
                          help="a cover: transcribe the melody of this audio (a hum, a sung or played melody; any "
                               "format libsndfile reads) and render its score byte for byte with cot melody, the "
                               "style and lyrics; the transcription's warnings go to stderr and its record to "
                               "result.json and transcription.json (docs/covers.md)")
    add_knob_flags(generate, "with --melody-audio: ")
    generate.add_argument("--cot", choices=("full", "melody", "off"),
                          help="chain of thought: full (chord-annotated score first), melody (melody-only score), "
                               "off (no score, paired CFG 1.01); default: the request's, else full")
    generate.add_argument("--seed", type=int, help="sampling and noise seed in [0, 2**63); default: the request's, "
                                                  "else 831001")
    generate.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale in [0, 20] (≠ 1 runs two "
                                                          "rows: a paired CFG request on vLLM, see --cfg-engine); "
                                                          "default: 1, or 1.01 for cot off")
    generate.add_argument("--id", help="song id and output directory name; default: the request's, else "
                                       "'first_song' for the embedded example, else 'song'")
    generate.add_argument("--instrumental", action="store_true", default=None,
                          help="upstream's instrumental recipe: plan a score (with section tags when no lyrics are "
                               "given), move its vocal melody to the instrument, render that (docs/instrumental.md)")
    generate.add_argument("--seconds", type=float,
                          help="cap the song at this many seconds: its semantic tokens at 25 a second (upstream's "
                               "count), refused when the prompt, score and song cannot fit the 24,576-token context; "
                               "a capped song records truncated.semantic and can be continued (default: the "
                               "semantic phase's max_tokens, 360 s)")
    generate.add_argument("--continue", dest="continue_from", metavar="RUN_DIR",
                          help="continue the capped song in RUN_DIR to --seconds: the song its request with that "
                               "cap makes, going on from its codes; a new song in OUTPUT/<its id>.<seconds>s "
                               "(or --id), whose result.json names its parent")
    generate.add_argument("--stage", choices=("plan", "audio"), default="audio",
                          help="stop after the score (plan) or make the whole song (audio)")
    generate.add_argument("--takes", type=lambda t: _integer_in(t, 1, 8, "an integer in [1, 8]"), default=1,
                          help="whole songs from this request, run at once (take k: seed + k - 1; take 1 in the "
                               "usual directory, take k in ID/takes/k; ID/takes.json lists them)")
    generate.add_argument("--best-of", action="store_true",
                          help="mark the take with the highest signal as the pick in takes.json (needs --takes >= 2)")
    generate.add_argument("--takes-share-score", action="store_true",
                          help="plan one score (take 1's) and render every take from it")
    generate.add_argument("--scorer", help="command run as 'CMD TAKE_DIR' per finished take; the number it prints "
                                           "(higher is better) replaces the model's mean log-prob for the pick")
    generate.set_defaults(func=cmd_generate)

    batch = command("batch", "generate every request of a JSONL file")
    _model_flags(batch)
    batch.add_argument("--input", required=True, help="JSONL, one request object per line, each with a unique id "
                                                      "(a bad line fails alone, in OUTPUT/<id> or OUTPUT/_row<LINE>)")
    batch.add_argument("--cot", choices=("full", "melody", "off"), help="cot for rows that do not set one")
    batch.add_argument("--concurrency", type=_count, help="songs in flight at once (default: the engine's rows, "
                                                       "sized from --budget; 1 on the torch backend)")
    batch.set_defaults(func=cmd_batch)

    serve = command("serve", "serve songs over HTTP: a job API with live progress, durable jobs and a web page")
    _model_flags(serve, runs=False)
    serve.set_defaults(backend="auto", func=cmd_serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port; the status "
                                                               "line on stdout names it)")
    serve.add_argument("--max-concurrency", dest="concurrency", type=_count,
                       help="songs in flight at once (default: the engine's rows, sized from --budget; 1 on the "
                            "torch backend)")
    serve.add_argument("--queue-size", type=_count, default=64, help="jobs waiting to start before POST answers 429")
    serve.add_argument("--max-takes", type=lambda t: _integer_in(t, 1, 8, "an integer in [1, 8]"), default=8,
                       help="the most takes one POST may ask for (each take counts as a song in the queue)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /metrics (at least 16 "
                                         "characters); default: $YUE2_API_KEY, else no key")
    serve.add_argument("--data-dir", default="serve-data", help="the job database (jobs.sqlite3) and each job's "
                                                                "files (jobs/<id>/)")
    serve.add_argument("--allowed-host", action="append", metavar="NAME",
                       help="a Host name this server answers to besides loopback names and IP addresses (repeat "
                            "for more; '*': any, which gives up the DNS-rebinding check)")
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="listen on a --host beyond loopback without an API key (refused otherwise)")
    serve.add_argument("--max-sse-clients", type=_count, default=256,
                       help="event streams open at once before GET .../events answers 503 (default %(default)s)")
    serve.add_argument("--max-connections", type=_count, default=1024,
                       help="HTTP connections and tasks at once before the server answers 503 (default "
                            "%(default)s)")
    serve.add_argument("--speech-timeout", type=_positive_seconds, default=900.0, metavar="SECONDS",
                       help="POST /v1/audio/speech waits this long for its song, then answers 504 naming the job, "
                            "which goes on (default %(default)s)")
    serve.add_argument("--max-waiting-calls", type=_count, default=256, metavar="N",
                       help="POST /v1/audio/speech calls waiting for their songs at once (no thread each) before "
                            "the next answers 503 with Retry-After (default %(default)s)")
    serve.add_argument("--max-upload-mb", type=lambda t: _positive(t, "MB"), default=40, metavar="MB",
                       help="the largest upload POST /v1/transcriptions and POST /v1/covers take (the audio and its "
                            "fields; 1 MB = 10**6 bytes): past it they answer 413 naming it; the JSON routes keep "
                            "their own 256 KiB (default %(default)s)")
    serve.add_argument("--transcription-workers", type=_count, default=1, metavar="N",
                       help="transcriptions (covers, hums) run at once, each in its own process beside the songs "
                            "(default %(default)s)")
    serve.add_argument("--transcription-queue", type=lambda t: _integer_in(t, 0, None, "an integer >= 0"), default=4,
                       metavar="N", help="transcriptions waiting for a worker before the next call answers 429 "
                                         "(default %(default)s)")
    serve.add_argument("--sheetsage-device", choices=("auto", "cuda", "cpu", "off"),
                       help="where SheetSage2 transcribes (docs/covers.md): auto (the GPU in bf16 when 8 GiB stays "
                            "free beside the engine, else the CPU), cuda, cpu, or off (refused with 503: its weights "
                            "are CC BY-NC 4.0, non-commercial); default: $YUE2_SHEETSAGE_DEVICE, else auto")
    serve.add_argument("--stall-seconds", type=_positive_seconds, default=300.0,
                       help="songs in flight but none progressed for this long: /health answers 503 (default "
                            "%(default)s)")
    serve.add_argument("--retention", type=_retention, default=RETENTION_SECONDS, metavar="SECONDS",
                       help="purge finished jobs (files and row) this long after they finished; 'forever' keeps "
                            "them (default %(default)s: a week)")
    serve.add_argument("--min-free-disk", type=_positive_float, default=1.0, metavar="GIB",
                       help="free disk kept beyond what every admitted song may still write (its FLAC, arrays and "
                            "records at its token budgets); POST answers 507 past it (default %(default)s)")
    _cluster_flags(serve)

    transcribe = command("transcribe", "transcribe the melody of an audio file into a melody-mode ABC score, the score "
                                       "a cover renders (docs/covers.md)")
    transcribe.add_argument("audio", metavar="AUDIO", help="the audio: any format libsndfile reads (WAV, FLAC, OGG, "
                                                           "MP3, AIFF, ...), 1 s up to the transcriber's limit")
    transcribe.add_argument("--output", required=True, help="where the score goes (e.g. score.abc)")
    transcribe.add_argument("--record", help="where its record goes (transcription.json: the notes, warnings, "
                                             "tempo figures); default: beside --output as NAME.transcription.json")
    add_knob_flags(transcribe)
    transcribe.add_argument("--lyrics", help="the song's lyrics: their [verse]/[chorus] tags become the score's "
                                             "section labels, their syllables are counted against the notes")
    transcribe.add_argument("--lyrics-file", help="read the lyrics from this UTF-8 file")
    transcribe.set_defaults(func=cmd_transcribe)

    doctor = command("doctor", "versions, devices, which backends are usable, and the engine / torch memory split")
    doctor.add_argument("--model", help=MODEL_HELP + "; for the memory split")
    doctor.add_argument("--vae", help=VAE_HELP)
    doctor.add_argument("--revision", help="--model's Hub revision (default: main)")
    doctor.add_argument("--vae-revision", help="--vae's Hub revision (default: main)")
    doctor.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    doctor.add_argument("--budget", type=_positive_float, default=None,
                        help="memory budget in GiB (default: a discrete GPU's memory less 10 %%, on unified memory "
                             "the pool: MemAvailable less the OS reserve, on the CPU 24 or the machine's memory "
                             "less 10 %%, the lesser)")
    doctor.add_argument("--concurrency", type=_count, help="engine rows (default: sized from the budget)")
    doctor.add_argument("--offload-ar", action="store_true", help="plan for --offload-ar")
    doctor.add_argument("--kv-cache-dtype", choices=KV_FORMS, default="auto",
                        help="plan for this engine KV cache form (default: auto)")
    doctor.add_argument("--reproducible", action="store_true",
                        help="show the attention backend each KV form gets under --reproducible (vLLM's "
                             "batch-invariant mode on CUDA sm80+)")
    doctor.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                        help="check these adapters (read, checked and converted) and report each, or its problem")
    _cluster_flags(doctor)
    doctor.set_defaults(func=cmd_doctor)

    derive = command("derive", "write the Qwen3 AR checkpoint vLLM serves (cached by content)")
    derive.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="YuE2 MoT directory or Hugging Face repo id (default: %(default)s, upstream's model)")
    derive.add_argument("--revision", help="the repo id's Hub revision (default: main)")
    derive.add_argument("--out", help="cache directory; default: $YUE2_CACHE, $HF_HOME or ~/.cache/huggingface, "
                                      "then yue2-ar/")
    derive.add_argument("--verify-hashes", action="store_true",
                        help="re-hash the source weights and a cached derivation instead of trusting size+mtime")
    derive.set_defaults(func=cmd_derive)

    calibrate = command("calibrate", "build a calibration corpus from the model's own generations")
    _model_flags(calibrate)
    calibrate.set_defaults(output="calibration-corpus", backend="torch")
    calibrate.add_argument("--requests", help="request set JSON; default: calibration/requests.json")
    calibrate.add_argument("--window", type=int, default=8192, help="window length in tokens (at most 8192)")
    calibrate.add_argument("--limit", type=int, help="only the first N requests; default: all")
    calibrate.set_defaults(func=cmd_calibrate)

    evaluate = command("evaluate", "quality gate: candidate AR vs the bf16 reference, per phase")
    evaluate.add_argument("--reference", required=True, help="torch:MODEL_DIR (the bf16 MoT)")
    evaluate.add_argument("--candidate", action="append",
                          help="torch:DIR[#int8|#fp8] or vllm:AR_CHECKPOINT_DIR (repeatable)")
    evaluate.add_argument("--corpus", required=True, help="a corpus from `yue2-vllm calibrate` (held-out split)")
    evaluate.add_argument("--output", default="quality", help="directory for quality.md/json and the plots")
    evaluate.add_argument("--no-floor", action="store_true", help="skip the bf16-vs-bf16 floor row")
    evaluate.add_argument("--kv-cache-dtype", action="append", choices=KV_FORMS[1:],
                          help="instead of --candidate: the FP8 KV row, this KV form against bf16 K/V on the same "
                               "AR checkpoint (--reference vllm:AR_DIR, or torch:MOT_DIR to derive it), per phase "
                               "(repeat for more forms; docs/kv-cache.md)")
    evaluate.set_defaults(func=cmd_evaluate)

    # Its flags belong to yue2_vllm.quant.export, which needs torch: they are parsed there (`quantize --help`).
    quantize = command("quantize", "write a quantized (FP8/int8) drop-in AR checkpoint: MODEL --scheme S --out DIR "
                                   "(run from .venv-quant: bash calibration/setup-quant-env.sh)", add_help=False)
    quantize.set_defaults(func=cmd_quantize)

    from .. import bench  # light: it imports torch/vLLM only when it runs

    bench_parser = command("bench", "AR prefill/decode per phase and precision at 1 and N songs, NAR and VAE speed, "
                                    "peak memory, engine start: one table (JSON + Markdown)")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.main_from_args)

    tiny = command("make-tiny", "write the tiny deterministic MoT + VAE checkpoints into DIR")
    tiny.add_argument("directory", help="where YuE2-3B-tiny/ and YuE2-Vae-tiny/ go")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed")
    tiny.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "quantize":
        args.export_arguments = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    import logging
    import threading

    # The pipeline's notes (a backend fallback, what a resume keeps) are one stderr line each.
    notes = logging.StreamHandler(sys.stderr)
    notes.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("yue2_vllm")
    logger.addHandler(notes)
    logger.setLevel(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only there can Python handle signals
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return args.func(args)
    except KeyboardInterrupt as exc:
        status = getattr(exc, "status", None) or {"status": "cancelled",
                                                  "reason": f"cancelled by {_signal_name(exc)}"}
        print_status(status)
        print("yue2-vllm: cancelled; rerun with --resume", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except (ValueError, OSError) as exc:  # UsageError, CheckpointError, a full disk, ...
        print_status({"status": "failed", "type": error_type(exc), "reason": str(exc)})
        print(f"yue2-vllm: error: {exc}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(notes)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
