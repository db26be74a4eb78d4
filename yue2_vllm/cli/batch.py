"""`yue2-vllm batch`: one song per JSONL row through the song scheduler; a bad row fails alone.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..request_json import UsageError, error_type, parse_json, request_from_json
from .generate import handle_status
from .setup import _signal_name, print_status, song_setup, write_json_atomic

class BatchProgress:
    """One tqdm bar per stage across the batch's songs (songs that finished each stage)."""

    STAGES = (("plan", "Planned"), ("semantic", "Generated"), ("synthesis", "Synthesized"), ("audio", "Decoded"))

    def __init__(self, enabled: bool, total: int):
        self.bars = {}
        self.tokens = 0
        if enabled:
            from tqdm import tqdm

            self.bars = {stage: tqdm(total=total, desc=label, unit="song", file=sys.stderr, position=i, leave=True)
                         for i, (stage, label) in enumerate(self.STAGES)}

    def on_event(self, event) -> None:
        """A scheduler listener (called from the song threads)."""
        if event.kind == "tokens":
            self.tokens += 1
        elif event.kind == "stage_done" and event.data["stage"] in self.bars:
            self.bars[event.data["stage"]].update(1)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


@dataclass(frozen=True)
class RowError:
    """Why a batch row never became a request."""

    type: str  # the underlying exception's class name (error_type), as upstream records it
    reason: str  # "FILE:LINE: message"
    line: int


class Covers:
    """The batch's covers (rows with `melody_audio`): each melody transcribed once (the rows are read twice, before
    and after the model loads), its warnings and licence told once on stderr, and by song id the transcription
    whose transcription.json goes into the song's directory once it is made."""

    def __init__(self):
        self.transcribed: dict[tuple, object] = {}
        self.of_song: dict[str, object] = {}

    def request(self, fields: dict, melody, row: str):
        """The row's SongRequest: a cover of `melody` (a MelodyAudio), or the plain song without one."""
        from ..cover import cover_request
        from ..protocol import SongRequest
        from .transcribe import cover_of, report

        def build(values: dict, transcription):
            return SongRequest(**values) if transcription is None else cover_request(transcription, **values)

        if melody is None:
            return SongRequest(**fields)
        key = (str(melody.path), json.dumps(melody.knobs, sort_keys=True), fields.get("lyrics", ""))
        if key not in self.transcribed:
            request, transcription = cover_of(fields, melody, build)
            report(transcription, row)
            self.transcribed[key] = transcription
        else:
            request = cover_request(self.transcribed[key], **fields)
        self.of_song[request.id] = self.transcribed[key]
        return request

    def finished(self, status: dict) -> dict:
        """A song's status line; a made cover's transcription.json written beside its score, and named."""
        from .transcribe import summary_line, write_record

        transcription = self.of_song.get(status.get("id"))
        if transcription is not None and status.get("status") in ("complete", "planned"):
            write_record(Path(status["directory"]), transcription)
            status = {**status, "transcription": summary_line(transcription)}
        return status


def _batch_rows(path: Path, default_cot: str | None, check=None, default_adapters: tuple = (),
                covers: Covers | None = None) -> list[tuple[str, object, dict, RowError | None]]:
    """`(id, request, overrides, error)` per non-blank JSONL line; a bad row becomes an error, not an abort.

    Lines are decoded one by one, so a line that is not UTF-8 fails alone. `check(request,
    overrides)` may refuse a row before any song starts (e.g. overrides outside the pipeline's
    limits). A row's id is its song id, or `_row<LINE>` when it has no usable id of its own (a name
    no song id can take), so every failure has a directory of its own. A row with `melody_audio` is a cover, its
    melody transcribed through `covers` (bad audio fails the row alone)."""
    from ..protocol import valid_song_id
    from ..takes import check_takes_for, pop_take_options

    covers = covers if covers is not None else Covers()

    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as exc:
        raise UsageError(f"--input {path}: {exc.strerror or exc}") from None
    rows, seen = [], set()
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        row_id = f"_row{number}"
        try:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})",
                                 exc) from None
            data = parse_json(line)
            if isinstance(data, dict) and valid_song_id(data.get("id")) and data["id"] not in seen:
                row_id = data["id"]
            seen.add(row_id)
            if isinstance(data, dict) and default_cot and "cot" not in data and "melody_audio" not in data:
                data["cot"] = default_cot  # a cover's is melody
            if isinstance(data, dict) and default_adapters and "adapters" not in data:  # --lora, unless the row names
                data["adapters"] = [{"name": name, "scale": scale} for name, scale in default_adapters]
            options = pop_take_options(data) if isinstance(data, dict) else None
            fields, overrides = request_from_json(data, path.parent, "row")
            melody = fields.pop("melody_audio", None)
            if melody is not None and "id" not in data:  # said before the melody is transcribed
                raise UsageError("missing 'id' (each batch row needs a unique id)")
            if melody is not None and valid_song_id(data["id"]) and data["id"] != row_id:
                raise UsageError(f"duplicate id {data['id']!r}")
            request = covers.request(fields, melody, f"{path}:{number}")
            if "id" not in data:
                raise UsageError("missing 'id' (each batch row needs a unique id)")
            if request.id != row_id:
                raise UsageError(f"duplicate id {request.id!r}")
            if check is not None:
                check(request, overrides)
            if options is not None and options.many:
                check_takes_for(request, options, "audio")
                overrides = {**overrides, "takes": options}  # the row's takes ride with its overrides
            rows.append((request.id, request, overrides, None))
        except (ValueError, TypeError, OSError, RecursionError) as exc:
            rows.append((row_id, None, {}, RowError(error_type(exc), f"{path}:{number}: {exc}", number)))
    return rows


def _row_check(pipe, admitted: dict):
    """Row check: overrides resolve over the pipeline's generation config and the prompts fit; each row's adapters,
    resolved by the check, are kept in `admitted` (by song id) for its song."""
    def check(request, overrides) -> None:
        admitted[request.id] = pipe.check_request(request, overrides.get("abc"), overrides.get("semantic"))

    return check


def invalid_row_status(directory: Path, error: RowError) -> dict:
    """The record of an invalid batch row: its status line, its batch.json result and its own failure.json
    (never written over a run) are this one record, as upstream's batch keeps them."""
    from ..artifacts import STATE_FILE, RunDirectory

    status = {"status": "failed", "id": directory.name, "directory": str(directory), "type": error.type,
              "reason": error.reason, "line": error.line}
    if not (directory / STATE_FILE).exists():
        directory.mkdir(parents=True, exist_ok=True)
        RunDirectory(directory).write_failure(status)
    return status


class TakesRow:
    """A row with takes: `takes.run_takes` in its own thread (a shared score waits for take 1's plan)."""

    def __init__(self, scheduler, request, directory: Path, overrides: dict, resume: bool):
        import threading

        from ..takes import run_takes

        self.request, self.directory, self.handles = request, directory, {}
        self.document: dict | None = None
        self.error: BaseException | None = None
        options = overrides["takes"]
        song_overrides = {k: v for k, v in overrides.items() if k != "takes"}

        def run():
            try:
                self.document = run_takes(scheduler, request, directory, options, overrides=song_overrides,
                                          resume=resume, on_take=self.handles.__setitem__)
            except BaseException as exc:  # e.g. a take id already in flight: the row fails alone
                self.error = exc

        self.thread = threading.Thread(target=run, name=f"yue2-takes-{request.id}", daemon=True)
        self.thread.start()

    def status(self) -> dict:
        """The row's status line: complete once every take is; which did and which did not."""
        self.thread.join()
        if self.document is None:
            return {"status": "failed", "id": self.request.id, "directory": str(self.directory),
                    "type": type(self.error).__name__, "reason": str(self.error)}
        document = self.document
        return {"status": "complete" if not document["not_complete"] else "failed", "id": self.request.id,
                "directory": str(self.directory), "takes": document["takes"], "complete": document["complete"],
                "not_complete": document["not_complete"], "pick": document["pick"],
                "results": [{k: r.get(k) for k in ("take", "seed", "status", "directory", "signals", "error")}
                            for r in document["results"]]}


def cmd_batch(args) -> int:
    covers = Covers()  # the rows' melodies, transcribed in the first reading, before any model loads
    _batch_rows(Path(args.input), args.cot, covers=covers)  # an unreadable file stops here, before any model loads
    setup = song_setup(args)
    with setup.pipeline() as pipe:
        admitted: dict = {}
        rows = _batch_rows(Path(args.input), args.cot, _row_check(pipe, admitted), setup.song_adapters, covers)
        return _run_batch(pipe, rows, args, admitted, covers)


def _run_batch(pipe, rows, args, admitted: dict, covers: Covers | None = None) -> int:
    """Every valid row through the song scheduler (`--concurrency` at once); batch.json after each song.

    batch.json lists the finished rows in row order; `all_attempted` turns true once every row was
    attempted, and `complete` (upstream's meaning) once every row was attempted and none failed. On a full disk
    the batch goes on: a row that cannot write its files fails with the reason, and a batch.json that cannot be
    written keeps its last version (written atomically) and is written again after the next song.
    """
    import time

    from ..scheduler import SongScheduler

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    summary = {"complete": False, "all_attempted": False, "expected": len(rows), "failed": 0, "results": []}
    finished: dict[int, dict] = {}
    start = time.perf_counter()

    def save_summary() -> bool:
        try:
            write_json_atomic(output / "batch.json", summary)
        except OSError as exc:  # e.g. a full disk: the last batch.json stays as it was
            print(f"yue2-vllm: warning: {exc}; batch.json keeps its last version and is written again after the "
                  "next song", file=sys.stderr)
            return False
        return True

    def record(index: int, status: dict) -> None:
        if covers is not None:
            status = covers.finished(status)
        finished[index] = status
        summary["failed"] = sum(s["status"] != "complete" for s in finished.values())
        summary["results"] = [finished[i] for i in sorted(finished)]
        save_summary()
        print_status(status)

    progress = BatchProgress(not args.quiet, len(rows))
    for index, (row_id, request, overrides, error) in enumerate(rows):
        if error is not None:
            record(index, invalid_row_status(output / row_id, error))
    valid = [(index, request, overrides) for index, (_, request, overrides, error) in enumerate(rows)
             if error is None]
    with SongScheduler(pipe, concurrency=args.concurrency, listener=progress.on_event) as scheduler:
        takes = {index: TakesRow(scheduler, request, output / request.id, overrides, args.resume)
                 for index, request, overrides in valid if "takes" in overrides}
        handles = {scheduler.submit(request, output / request.id, overrides=overrides, resume=args.resume,
                                    adapters=admitted.get(request.id)): index
                   for index, request, overrides in valid if index not in takes}
        try:
            for handle in scheduler.as_completed(handles):
                record(handles[handle], handle_status(handle, args.quiet))
            for index, row in takes.items():
                record(index, row.status())
        except KeyboardInterrupt as exc:  # stop every song at its next boundary, record them, then stop
            for handle in [*handles, *(h for row in takes.values() for h in row.handles.values())]:
                handle.cancel()
            for handle in scheduler.as_completed([h for h in handles if handles[h] not in finished]):
                record(handles[handle], handle_status(handle, args.quiet, f"cancelled by {_signal_name(exc)}; "
                                                                           "rerun with --resume"))
            for index, row in takes.items():
                if index not in finished:
                    record(index, row.status())
            raise
    progress.close()
    seconds = time.perf_counter() - start
    summary["all_attempted"] = True
    summary["complete"] = summary["failed"] == 0
    saved = save_summary()
    done = len(rows) - summary["failed"]
    print_status({"status": "batch", "songs": len(rows), "completed": done, "failed": summary["failed"],
                  "concurrency": scheduler.concurrency, "seconds": round(seconds, 3),
                  "songs_per_s": round(done / seconds, 4), "ar_tokens_per_s": round(progress.tokens / seconds, 1)})
    if not saved:
        print(f"yue2-vllm: error: {output / 'batch.json'} could not be written; free space and rerun with --resume",
              file=sys.stderr)
    return 1 if summary["failed"] or not saved else 0
