"""Where a request's temperature goes, from the HTTP body to the target's `logits_to_probs`: every function of the
project that receives it, in order, the types that hold it, and the files it is handed between.

One `/v1/completions` request goes through a whole stack in this process (the coordinator without Ray, a draft and a
target replica over gRPC on localhost, tiny models) with a profile hook on every thread. The temperature is a
value no other field of the request holds (0.6171875, exact in float32).

- A *stop* is a call of a function of the project with the value reachable from its arguments other than `self`
  (through attributes, fields, dict values and proto fields, at most three levels down). A generator's or a
  coroutine's first run is its call; its later resumptions are not calls. Its *forms* are the types that hold the
  value as a field; a stop that returns the value in a type none of its arguments or its object held it in is a
  *conversion*.
- The *path* runs from the HTTP door's handler to the target's first `logits_to_probs`, without the draft model's
  own drafting (a branch the target's verify does not depend on). Each stop belongs to the process it would run in
  deployed: the coordinator, the draft replica or the target replica (by its thread's name, else by the service its
  asyncio task entered first).
- A *hand-off* is a stop whose nearest caller in the project is in another file. Within one call a process serves
  (the coordinator's request; each RPC a replica serves, from its handler on: what StartSession stored in a
  session reaches a later Verify through the session, not through calls), a hand-off into a file the walk had
  entered before, with no function of that file still on the stack, *returns to a file it left*. Returning to a
  caller does not; nor does a hand-off the walk already made (the same function called from the same file again:
  the next round's call, or the draft's session started as the target's was), which a reader has already
  followed.

    python experiments/request_walk.py [--mode sd] [--json]

`tests/test_request_walk.py` runs the same walk and holds the request path to it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import inspect
import json
import sys
import threading
from collections import ChainMap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VALUE = 0.6171875
PACKAGES = ("specdec", "specdec_rpc", "coordinator", "draft_service", "target_service")
MAX_DEPTH = 3
MAX_ITEMS = 64
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
SERVICES = (("coordinator/", "coordinator"), ("draft_service/", "draft"), ("target_service/", "target"))
# a replica's RPC handlers (named as the service's methods): each call into one from outside the file (the gRPC
# interceptor, a per-round stream's reader, the frame port) begins a call the replica serves
DOORS = {"draft_service/servicer.py": "draft", "target_service/servicer.py": "target"}
# the process an asyncio task's calls belong to: the first service package the task (or the one that made it) ran
_PROCESS: contextvars.ContextVar[str] = contextvars.ContextVar("process", default="")


def _is_value(v) -> bool:
    return isinstance(v, float) and v == VALUE


def _children(obj):
    """(child) values of obj one level down: fields, attributes, items."""
    from google.protobuf.message import Message

    if isinstance(obj, Message):
        for f, v in obj.ListFields():
            if getattr(f, "is_repeated", False):
                yield from list(v)[:MAX_ITEMS] if not hasattr(v, "items") else list(v.values())[:MAX_ITEMS]
            else:
                yield v
        return
    if isinstance(obj, dict):
        yield from list(obj.values())[:MAX_ITEMS]
        return
    if isinstance(obj, ChainMap):  # a view over other mappings: what it reads, not a holder of its own
        yield from obj.maps
        return
    if isinstance(obj, (list, tuple)):
        yield from obj[:MAX_ITEMS]
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield getattr(obj, f.name, None)
        return
    fields = getattr(type(obj), "model_fields", None)  # pydantic
    if isinstance(fields, dict):
        for name in fields:
            yield getattr(obj, name, None)
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and type(obj).__module__.split(".")[0] in PACKAGES:
        yield from list(d.values())[:MAX_ITEMS]


def holders(obj, depth: int = 0, seen=None) -> set[str]:
    """The types (module.qualname) that hold VALUE as a field, in obj or below it."""
    if seen is None:
        seen = set()
    if depth > MAX_DEPTH or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return set()
    seen.add(id(obj))
    out = set()
    try:
        kids = list(_children(obj))
    except Exception:  # noqa: BLE001 - a type we cannot walk holds nothing we count
        return out
    for kid in kids:
        if _is_value(kid):
            t = type(obj)
            out.add(f"{t.__module__}.{t.__qualname__}")
        else:
            out |= holders(kid, depth + 1, seen)
    return out


@dataclasses.dataclass
class Stop:
    file: str
    function: str
    thread: str
    forms: list[str]
    process: str = ""  # the service whose asyncio task made the call ("": a thread's, known by its name or stack)
    door: bool = False  # a call a replica serves begins here (its servicer's handler), the value in it or not
    stack: list[str] = dataclasses.field(default_factory=list)  # the project files its callers are in (this thread)
    returned: list[str] = dataclasses.field(default_factory=list)  # forms of the return value that args lacked


class Walk:
    def __init__(self):
        self.stops: list[Stop] = []
        # id(frame) -> (the stop its call made, or None; the forms its arguments and its object held)
        self._open: dict[int, tuple[Stop | None, set[str]]] = {}
        self._files: dict[str, str | None] = {}  # a code object's file -> its path in the project (None: not in it)
        self._lock = threading.Lock()
        self._resumed: dict[int, object] = {}  # id(frame) -> frame of each generator and coroutine begun
        self.on = False

    def _rel(self, filename: str) -> str | None:
        if filename not in self._files:
            try:
                rel = Path(filename).resolve().relative_to(ROOT)
                self._files[filename] = str(rel) if rel.parts[0] in PACKAGES else None
            except ValueError:
                self._files[filename] = None
        return self._files[filename]

    def hook(self, frame, event, arg):
        if not self.on or event not in ("call", "return"):
            return
        rel = self._rel(frame.f_code.co_filename)
        if rel is None:
            return
        if frame.f_code.co_flags & _RESUMABLE:  # a generator or coroutine: its first run is its call
            if event == "return" or id(frame) in self._resumed:  # suspended, or resumed: neither is a call
                return
            self._resumed[id(frame)] = frame  # held: its id stays its own while the walk runs
        if event == "call":
            if not _PROCESS.get():
                for pkg, name in SERVICES:
                    if rel.startswith(pkg):
                        _PROCESS.set(name)
            name = frame.f_code.co_name
            if rel in DOORS and name[:1].isupper() and self._callers(frame)[:1] != [rel]:
                with self._lock:
                    self.stops.append(Stop(rel, frame.f_code.co_qualname, threading.current_thread().name, [],
                                           DOORS[rel], door=True))
            forms = set()
            names = frame.f_code.co_varnames[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
            bound = names[:1] in (("self",), ("cls",))
            for name in names[1:] if bound else names:  # what it was handed
                v = frame.f_locals.get(name)
                if not _is_value(v):
                    forms |= holders(v)
            own = holders(frame.f_locals.get(names[0])) if bound else set()  # what its object holds already
            stop = None
            if forms:
                stop = Stop(rel, frame.f_code.co_qualname, threading.current_thread().name, sorted(forms),
                            _PROCESS.get(), stack=self._callers(frame))
                with self._lock:
                    self.stops.append(stop)
            if forms or own:
                self._open[id(frame)] = (stop, forms | own)
            return
        stop, had = self._open.pop(id(frame), (None, set()))
        new = holders(arg) - had
        if not new:
            return
        if stop is None:  # the value's holder made from arguments that held it bare (or from text)
            stop = Stop(rel, frame.f_code.co_qualname, threading.current_thread().name, [], _PROCESS.get())
            with self._lock:
                self.stops.append(stop)
        stop.returned = sorted(new)

    def _callers(self, frame) -> list[str]:
        out, f = [], frame.f_back
        while f is not None:
            rel = self._rel(f.f_code.co_filename)
            if rel is not None:
                out.append(rel)
            f = f.f_back
        return out

    def install(self):
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)

    def remove(self):
        sys.setprofile(None)
        threading.setprofile(None)


async def _run(walk: Walk, tmp: Path, mode: str) -> list[Stop]:
    import httpx

    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator
    from coordinator.stack import free_port
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import save_tiny_tokenizer, start_replica, tiny_pair

    tok = load_tokenizer(save_tiny_tokenizer(tmp / "tok"))
    target, draft = tiny_pair()
    t = await start_replica("target", target)
    d = await start_replica("draft", draft, preverifier="random")
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING",
                            http_port=free_port(), served_model_name="tiny")
    app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
    await app.start()
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": VALUE, "seed": 7,
            "mode": mode}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=60) as http:
            await http.post("/v1/completions", json=body)  # warm: first-call imports and builds are not the walk
            walk.on = True
            r = await http.post("/v1/completions", json=body)
            walk.on = False
            r.raise_for_status()
    finally:
        walk.on = False
        for a in (app, t, d):
            await a.shutdown(0)
    return walk.stops


def record(mode: str = "sd") -> list[Stop]:
    """The walk of one request in `mode`, recorded."""
    import tempfile

    walk = Walk()
    walk.install()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return asyncio.run(_run(walk, Path(tmp), mode))
    finally:
        walk.remove()


def path_to_verify(stops: list[Stop]) -> list[Stop]:
    """The value's path: from the HTTP door's handler (coordinator/http_api/app.py; the framework's body parsing
    before it is not the project's walk) to the target's first `logits_to_probs` (the one its worker verifies with),
    without the draft model's own drafting (a branch: the draft samples at the temperature, the target's verify
    does not depend on it)."""
    start = next(i for i, s in enumerate(stops) if s.file == "coordinator/http_api/app.py")
    out = []
    for s in stops[start:]:
        if s.thread.startswith("draft-"):
            continue
        out.append(s)
        if s.function == "logits_to_probs" and s.thread.startswith("target-"):
            break
    return out


def role(stop: Stop) -> str:
    """The process a stop belongs to in a deployment: the coordinator, the draft replica or the target replica (by
    its thread: a model's; else by its asyncio task: the service the task, or the task that made it, entered first;
    else by the outermost service package on its stack: a worker thread's)."""
    if stop.thread.startswith(("draft-", "target-")):
        return stop.thread.split("-")[0]
    if stop.process:
        return stop.process
    for f in reversed([stop.file] + stop.stack):
        for pkg, name in SERVICES:
            if f.startswith(pkg):
                return name
    return "coordinator"


def forms_in_order(stops: list[Stop]) -> list[str]:
    """The types that held the value, in the order they first did."""
    out: list[str] = []
    for s in stops:
        for f in s.forms + s.returned:
            if f not in out:
                out.append(f)
    return out


def handoffs(stops: list[Stop]) -> list[Stop]:
    """The stops where a function of one file hands the value to a function of another: its nearest caller in the
    project is in another file. Calls within a file, and calls from outside the project (a framework calling a
    validator, a thread pool running a task), are not hand-offs; a function that returns the value from its own
    state (a session table's lookup) hands nothing on."""
    return [s for s in stops if s.stack and s.stack[0] != s.file and not s.door]


def _edge(s: Stop) -> str:
    return f"{s.stack[0]} -> {s.file}:{s.function}"


def revisits(stops: list[Stop]) -> dict[str, list[str]]:
    """Per call a process serves (the coordinator's request; each call a replica serves, from its door: what a
    replica's session stored at StartSession reaches a later call through the session, not through calls): the
    hand-offs into a file the walk had left, where no function of that file is still on the stack. A return to the
    caller is not one; a second call into a file once its functions have returned is, unless it is a hand-off
    the walk already made (the same function called from the same file again: the next round's call, or the
    draft's session started as the target's was), which a reader has already followed."""
    out: dict[str, list[str]] = {}
    entered: dict[str, set[str]] = {}
    taken: dict[str, set[str]] = {}
    hand = {id(s) for s in handoffs(stops)}
    for s in stops:
        if s.door:
            entered[role(s)] = set()
            taken[role(s)] = set()
        if id(s) not in hand:
            continue
        files, edges = entered.setdefault(role(s), set()), taken.setdefault(role(s), set())
        if s.file in files and s.file not in s.stack and _edge(s) not in edges:
            out.setdefault(role(s), []).append(_edge(s))
        files.update((s.file, s.stack[0]))
        edges.add(_edge(s))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="sd")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    stops = path_to_verify(record(args.mode))
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in stops], indent=1))
        return
    for s in stops:
        if s.door:
            print(f"{role(s)[:6]:6} {s.thread[:14]:14} -- serves {s.function} ({s.file})")
            continue
        conv = f"  -> {', '.join(s.returned)}" if s.returned else ""
        print(f"{role(s)[:6]:6} {s.thread[:14]:14} {s.file}:{s.function}  [{', '.join(s.forms)}]{conv}")
    forms = forms_in_order(stops)
    print(f"\nforms, in order: {' -> '.join(forms)} ({len(forms) - 1} changes)")
    hand = handoffs(stops)
    print(f"hand-offs between files: {len(hand)}")
    for r in ("coordinator", "draft", "target"):
        where = revisits(stops).get(r, [])
        print(f"{r}: {sum(1 for h in hand if role(h) == r)} hand-offs, {len(where)} into a file it had left"
              + (": " + "; ".join(where) if where else ""))


if __name__ == "__main__":
    main()
