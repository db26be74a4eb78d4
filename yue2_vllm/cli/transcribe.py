"""`yue2-vllm transcribe`: a melody from audio as a melody-mode score (docs/covers.md); and the covers the other
commands make (`generate --melody-audio`, request files and batch rows with `melody_audio`): the audio transcribed
here, before any model loads, its score the song's byte for byte (cover.cover_request), its warnings and licence
on stderr, its transcription.json in the song's directory once the song is made.

The transcription room is imported only when a transcription runs: `yue2-vllm --help` imports no audio library.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..request_json import MELODY_KNOBS, MelodyAudio, UsageError, read_text_file

KNOB_FLAGS = {name: "--" + name.replace("_", "-") for name in MELODY_KNOBS}
RECORD_FILE = "transcription.json"


def add_knob_flags(parser, prefix: str = "") -> None:
    """The transcription's flags (TranscriptionRequest's fields but the lyrics); `prefix` words their help."""
    parser.add_argument("--transcriber", choices=("pyin", "sheetsage2"),
                        help=prefix + "pyin (built in: one melodic line, a hum, a whistle, a sung or played melody) or "
                                      "sheetsage2 (full mixes; set up with calibration/setup-sheetsage-env.sh, CC "
                                      "BY-NC 4.0); default: pyin")
    parser.add_argument("--bpm", type=float, help=prefix + "the tempo in quarter notes a minute, 30-300 (pyin; "
                                                           "default: found from the notes)")
    parser.add_argument("--meter", help=prefix + "the meter n/d, d one of 2, 4, 8, 16 (pyin; default 4/4)")
    parser.add_argument("--key", help=prefix + "the key as G, Bb, F#m (pyin; default: found from the pitch classes)")
    parser.add_argument("--voice", choices=("vocal", "ins", "both"),
                        help=prefix + "where the melody goes: vocal (pyin's default) or ins; sheetsage2: both "
                                      "(default), vocal or ins, the melody kept")
    parser.add_argument("--pickup-beats", type=float, help=prefix + "beats before the first downbeat, in quarter "
                                                                    "beats (pyin; default: found)")


def flag_knobs(args) -> dict:
    """The knob flags given (their TranscriptionRequest fields)."""
    return {name: getattr(args, name) for name in MELODY_KNOBS if getattr(args, name, None) is not None}


def sheetsage_gpu_free_bytes(transcriber: str) -> int | None:
    """For SheetSage2 where it may go to the GPU ($YUE2_SHEETSAGE_DEVICE auto or cuda): this machine's current CUDA
    device's free memory (None without one). The command transcribes before any model loads, and SheetSage2's worker
    has exited before one does, so the whole free memory is what its placement weighs."""
    if transcriber != "sheetsage2":
        return None
    from ..transcription.sheetsage import sheetsage_device

    if sheetsage_device() not in ("auto", "cuda"):
        return None
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None


def transcribe_source(melody: MelodyAudio, lyrics: str, flags=()):
    """`melody`'s audio transcribed with its knobs and the song's `lyrics` (their tags become the score's section
    labels). Bad audio or a bad knob is a UsageError in one line naming where it came from: the flag (the knobs
    in `flags` came from flags) or the document's field, and the file; nothing is written."""
    from ..transcription import TranscriberUnavailable, TranscriptionError, TranscriptionRequest, transcribe

    where, path = melody.where, melody.path

    def label(field: str) -> str:  # where: "" (transcribe's AUDIO), "--melody-audio", or a document
        if field == "audio":
            return {"": str(path), "--melody-audio": f"--melody-audio {path}"}.get(where,
                                                                                 f"{where}: melody_audio {path}")
        if field == "lyrics":
            return "lyrics"
        if field in flags or where in ("", "--melody-audio"):
            return KNOB_FLAGS.get(field, field)
        return f"{where}: melody.{field}"

    try:
        request = TranscriptionRequest.from_dict({**melody.knobs, "lyrics": lyrics})
        return transcribe(melody.path, request, gpu_free_bytes=sheetsage_gpu_free_bytes(request.transcriber))
    except TranscriptionError as exc:
        raise UsageError(f"{label(exc.field)}: {exc.reason}", exc) from None
    except TranscriberUnavailable as exc:
        raise UsageError(f"{label('transcriber')}: {exc}", exc) from None


def report(transcription, where: str = "", stream=None) -> None:
    """Its warnings (the drift with its figures among them) and its licence, a line each on stderr."""
    stream = stream or sys.stderr
    prefix = f"{where}: " if where else ""
    for warning in transcription.warnings:
        print(f"yue2-vllm: warning: {prefix}{warning.message}", file=stream)
    if transcription.licence:
        print(f"yue2-vllm: licence: {prefix}the score was transcribed by {transcription.transcriber}: "
              f"{transcription.licence}", file=stream)


def summary_line(transcription) -> dict:
    """What a status line says of a transcription."""
    return {"transcriber": transcription.transcriber, "transcriber_version": transcription.transcriber_version,
            "bpm": transcription.bpm, "meter": transcription.meter, "key": transcription.key,
            "notes": len(transcription.notes), "source_seconds": round(transcription.source.seconds, 3),
            "warnings": [warning.code for warning in transcription.warnings], "licence": transcription.licence}


def write_record(directory: Path, transcription) -> None:
    """The song's transcription.json (its notes included) beside its score.abc (the plan stage wrote that one)."""
    from ..checkpoint import write_bytes_atomic

    write_bytes_atomic(Path(directory) / RECORD_FILE, transcription.files()[RECORD_FILE])


def cover_of(fields: dict, melody: MelodyAudio, build, flags=()):
    """`(request, transcription)` of a cover: `build(fields, None)` -> SongRequest checks the song's fields first
    with a stand-in score (a bad field is refused before minutes of transcription), then the melody is transcribed
    with the song's lyrics and `build(fields, transcription)` makes the request around its score
    (cover.cover_request)."""
    from ..cover import COVER_COT

    if not fields.get("instrumental"):  # an instrumental's given score is edited: it needs the real one
        build({**fields, "abc": "X:1", "cot": COVER_COT}, None)
    transcription = transcribe_source(melody, fields.get("lyrics", ""), flags)
    return build(fields, transcription), transcription


def cmd_transcribe(args) -> int:
    """`transcribe AUDIO --output score.abc`: the score and, beside it, its transcription.json (or --record)."""
    from ..checkpoint import json_text, write_bytes_atomic

    lyrics = args.lyrics or ""
    if args.lyrics_file:
        if args.lyrics is not None:
            raise UsageError("--lyrics-file: give --lyrics or --lyrics-file, not both")
        lyrics = read_text_file(Path(args.lyrics_file), "--lyrics-file")
    output = Path(args.output)
    record = Path(args.record) if args.record else output.with_name(output.stem + ".transcription.json")
    if record.resolve() == output.resolve():
        raise UsageError(f"--record {record}: is --output; give the record another name")
    for flag, path in (("--output", output), ("--record", record)):
        if path.is_dir():
            raise UsageError(f"{flag} {path}: is a directory; give a file name")
    transcription = transcribe_source(MelodyAudio(Path(args.audio), flag_knobs(args), ""), lyrics)
    report(transcription)
    files = transcription.files()
    for path in (output, record):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(record, files[RECORD_FILE])
    write_bytes_atomic(output, files["score.abc"])
    status = {"status": "transcribed", "audio": args.audio, "score": str(output), "record": str(record),
              **summary_line(transcription), "seconds": round(transcription.timing["total_seconds"], 3)}
    print(json_text(status), flush=True)  # the status line (setup.print_status's, without importing setup)
    return 0
