"""The code reward's two sandboxed processes: the completion's program answers calls in one, the task's tests run in
the other, and only plain data crosses between them.

A completion's code can rewrite anything in the interpreter it runs in (``builtins``, ``compile``, ``exec``, the
harness's own functions and frames, the exit path), so no check that runs there can be trusted. Here it never
does:

* the **solution** process (:data:`SOLUTION`, in one sandbox) reads the program (the task's setup and the
  completion's code) from the checker, runs it, then answers calls: each request names a function of the program and
  gives its arguments; the answer is the return value, the exception raised (its type's name and message) or a
  timeout, and the arguments' new contents when the call changed them;
* the **checker** process (:data:`CHECKER`, in another sandbox; the completion's code never runs there) compiles the
  program (a syntax error is decided here), runs the task's setup (its helper functions are the task's, not the
  completion's), binds the task's entry points, the functions the setup declares without a body (docstrings,
  ``pass``, ``...`` and imports only: HumanEval's prompt) and every other name the tests use that the setup does not
  define to a stub that calls the solution, and runs each test under its own timer, in order, in that one namespace,
  as the tests would run in the program's. Arguments and results cross as plain data
  (:mod:`lightning_grpo.rewards.plain_data`, JSON): an object that fakes ``__eq__`` cannot cross, and a result is
  compared by the checker's own operators and builtins. A call that changed its arguments (a list sorted in place)
  changes the checker's arguments the same way, and an exception of a builtin type is raised again as that type,
  so ``check(candidate)`` means what it means in one process. ``random`` is seeded with 0 before each test (and in
  the solution once), so a task's random tests are the same at every scoring;
* the checker alone writes its standard output: one JSON object per line, ``{"syntax_error": true}``, or
  ``{"kept": [names]}`` (the setup's functions with a body of their own that the completion defines again, which the
  tests call in the setup's version, :data:`lightning_grpo.rewards.code.CodeReward` warns) when there are any, then
  ``{"program": kind}``, then ``{"test": i, "result": kind}`` per test, then ``{"done": true, "channel": state}``;
  what the tests print goes to ``/dev/null``. The solution's output is never read as a report.

Under the ``rlimits`` mechanism both processes share the machine's PID space (and, as root, the user ``nobody``):
the checker makes itself undumpable (``PR_SET_DUMPABLE`` 0: no ``ptrace``, no ``/proc/<pid>/mem`` or ``fd``) as its
first instruction, long before it sends the program, so the completion's code never runs while its checker can be
reached that way (it can still send it signals: a killed checker reports nothing, which scores 0).

Protocol on the two pipes (one JSON object per line, the checker's requests on one, the solution's answers on the
other): ``{"program": source, "timeout": s}`` -> ``{"program": "pass" | "fail" | "timeout" | "memory"}``, then
``{"id": n, "call": name, "args": plain [args, kwargs]}`` -> ``{"id": n, "return": plain value}`` or
``{"id": n, "raise": type name, "message": text}`` or ``{"id": n, "timeout": true}``, with ``"after": plain
[args, kwargs]`` when the call changed them. An answer that is not this (or longer than ``max_message_bytes``), a
closed pipe, or no answer within a second after a test's timer fired end the calls: every later call fails.
"""

from __future__ import annotations

import inspect

from lightning_grpo.rewards import plain_data

#: The codec's source, run first in both processes.
_CODEC = inspect.getsource(plain_data)

#: ``python -s -c SOLUTION <requests fd> <answers fd>``.
SOLUTION = _CODEC + r'''

import os as _os, random as _random, signal as _signal, sys as _sys


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _timed(function, timeout):
    _signal.signal(_signal.SIGALRM, _alarm)
    _signal.setitimer(_signal.ITIMER_REAL, timeout)
    try:
        return "return", function()
    except _Timeout:
        return "timeout", None
    except BaseException as err:
        return "raise", err
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)


def _serve(requests, answers):
    reader = _os.fdopen(requests, "rb")

    def send(message):
        data = memoryview((json.dumps(message, separators=(",", ":"), allow_nan=True) + "\n").encode())
        while data:
            data = data[_os.write(answers, data):]

    line = reader.readline()
    if not line:
        return
    task = json.loads(line)
    timeout, namespace = task["timeout"], {"__name__": "solution"}
    code = compile(task["program"], "solution.py", "exec")
    del task, line
    _random.seed(0)
    kind, value = _timed(lambda: exec(code, namespace), timeout)
    if kind == "raise":
        kind = "memory" if isinstance(value, MemoryError) else "fail"
    send({"program": "pass" if kind == "return" else kind})
    while True:
        line = reader.readline()
        if not line:
            return
        request = json.loads(line)
        answer, args, kwargs = {"id": request["id"]}, [], {}
        try:
            args, kwargs = decode(request["args"])
            function = namespace[request["call"]]
        except KeyError:
            kind, value = "raise", NameError("name %r is not defined" % request["call"])
        else:
            kind, value = _timed(lambda: function(*args, **kwargs), timeout)
        if kind == "return":
            try:
                answer["return"] = encode(value)
            except PlainDataError as err:
                kind, value = "raise", TypeError(str(err))
        if kind == "raise":
            answer["raise"] = type(value).__name__
            try:
                answer["message"] = str(value)[:2000]
            except BaseException:
                answer["message"] = ""
        elif kind == "timeout":
            answer["timeout"] = True
        try:
            after = encode([args, kwargs])
            if after != request["args"]:
                answer["after"] = after
        except PlainDataError:
            pass
        send(answer)


getattr(_sys, "set_int_max_str_digits", lambda digits: None)(0)
_serve(int(_sys.argv[1]), int(_sys.argv[2]))
'''

#: ``python -s -c CHECKER <answers fd> <requests fd>``, the task as JSON on standard input: ``program``, ``setup``,
#: ``tests``, ``entry_points``, ``timeout``, ``max_message_bytes``, ``mechanism``.
CHECKER = r'''
import sys as _sys
_sys.path[:] = [p for p in _sys.path if p not in ("", ".")]


def _undumpable():
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            return OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    except Exception as err:
        return err
    return None


_UNDUMPABLE = _undumpable()  # first, before the task is read
''' + _CODEC + r'''

import builtins as _builtins, os as _os, random as _random, select as _select, signal as _signal

GRACE_S = 1.0


class _Timeout(BaseException):
    pass


class _RemoteTimeout(_Timeout):
    pass


class RemoteGone(Exception):
    """The solution's process is gone, stuck or garbled: no more calls."""


def _alarm(signum, frame):
    raise _Timeout()


class _Masked:
    def __enter__(self):
        _signal.pthread_sigmask(_signal.SIG_BLOCK, [_signal.SIGALRM])

    def __exit__(self, *exc):
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [_signal.SIGALRM])


class _Timer:
    def __init__(self, seconds):
        self.seconds = seconds

    def __enter__(self):
        _signal.setitimer(_signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        _signal.setitimer(_signal.ITIMER_REAL, 0)


def _write(fd, message):
    data = memoryview((json.dumps(message, separators=(",", ":"), allow_nan=True) + "\n").encode())
    while data:
        data = data[_os.write(fd, data):]


class _Channel:
    def __init__(self, answers, requests, limit):
        self.answers, self.requests, self.limit = answers, requests, limit
        self.buffer, self.last, self.waiting, self.answered, self.state = bytearray(), 0, None, 0, "open"

    def fail(self, state, why):
        self.state = state
        raise RemoteGone(why)

    def send(self, message):
        try:
            _write(self.requests, message)
        except OSError:
            self.fail("closed", "the solution's process is gone")

    def receive(self):
        # the test's timer may end the wait for an answer (select), never the step from read bytes to the buffer
        # or from a line in the buffer to a noted answer: those run with SIGALRM blocked (it is handled after them)
        while True:
            end = self.buffer.find(b"\n")
            if 0 <= end <= self.limit:
                break
            if end > self.limit or len(self.buffer) > self.limit:
                self.fail("garbled", "an answer longer than %d bytes" % self.limit)
            _select.select([self.answers], [], [])
            with _Masked():
                chunk = _os.read(self.answers, 65536)
                self.buffer += chunk
            if not chunk:
                self.fail("closed", "the solution's process is gone")
        with _Masked():
            line = bytes(self.buffer[:end])
            del self.buffer[:end + 1]
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):
                message = None
            if type(message) is dict and type(message.get("id")) is int:
                self.answered = max(self.answered, message["id"])
        if type(message) is not dict:
            self.fail("garbled", "an answer that is not a JSON object")
        return message

    def program(self, timeout):
        try:
            with _Timer(timeout + GRACE_S):
                kind = self.receive().get("program")
        except _Timeout:
            self.state = "stuck"
            return "timeout"
        except RemoteGone:
            return "gone"
        if kind in ("pass", "fail", "timeout", "memory"):
            return kind
        self.state = "garbled"
        return "gone"

    def settle(self):
        try:
            with _Timer(GRACE_S):
                while self.answered < self.waiting:
                    self.receive()
            self.waiting = None
        except _Timeout:
            self.state = "stuck"
        except RemoteGone:
            pass

    def call(self, name, args, kwargs):
        if self.state != "open":
            raise RemoteGone("no more calls: the solution's process is %s" % self.state)
        try:
            payload = encode([list(args), dict(kwargs)])
        except PlainDataError as err:
            raise TypeError("%s: an argument cannot be sent to the solution: %s" % (name, err)) from None
        self.last += 1
        ident = self.waiting = self.last
        self.send({"id": ident, "call": name, "args": payload})
        message = self.receive()
        while message.get("id") != ident:
            message = self.receive()
        self.waiting = None
        return self.answer(message, args, kwargs)

    def answer(self, message, args, kwargs):
        try:
            if "after" in message:
                after = decode(message["after"])
                if not (type(after) is list and len(after) == 2 and type(after[0]) is list
                        and len(after[0]) == len(args) and type(after[1]) is dict):
                    raise PlainDataError("arguments of another shape")
                for old, new in zip(args, after[0]):
                    assign(old, new)
                for key, old in kwargs.items():
                    if key in after[1]:
                        assign(old, after[1][key])
            if "return" in message:
                return decode(message["return"])
        except PlainDataError as err:
            self.fail("garbled", str(err))
        if message.get("timeout") is True:
            raise _RemoteTimeout()
        kind, text = message.get("raise"), message.get("message")
        if type(kind) is not str:
            self.fail("garbled", "an answer without a result")
        text = text if type(text) is str else ""
        cls = getattr(_builtins, kind, None)
        error = None
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                error = cls(text)
            except Exception:
                error = None
        raise error if error is not None else RuntimeError("%s: %s" % (kind, text))


class _Remote:
    def __init__(self, name, channel):
        self.__name__ = self.__qualname__ = name
        self._channel = channel

    def __call__(self, *args, **kwargs):
        return self._channel.call(self.__name__, args, kwargs)

    def __repr__(self):
        return "<function %s of the solution>" % self.__name__


def _names(code):
    found = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            found |= _names(const)
    return found


def _declares(statement):
    import ast
    return isinstance(statement, (ast.Pass, ast.Import, ast.ImportFrom)) or (
        isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
        and (isinstance(statement.value.value, str) or statement.value.value is Ellipsis))


def _functions(tree):
    import ast
    return [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _stubs(setup):
    """The functions the setup declares without a body (docstrings, ``pass``, ``...`` and imports only, in any
    order: HumanEval/115 imports before its docstring): the ones to write."""
    import ast
    return [n.name for n in _functions(ast.parse(setup)) if all(_declares(s) for s in n.body)]


def _rewritten(setup, program):
    """The setup's top-level functions that the program's code after the setup (the completion's) defines again, or
    continues (a body written after the setup's last line): the functions the completion wrote."""
    import ast
    lines = setup.count("\n") + (0 if setup.endswith("\n") else 1)
    try:
        later = [n for n in _functions(ast.parse(program)) if n.end_lineno > lines]
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return []
    own = {n.name for n in _functions(ast.parse(setup))}
    return sorted({n.name for n in later} & own)


def _run(code, namespace, seconds):
    try:
        with _Timer(seconds):
            exec(code, namespace)
        return "pass"
    except _Timeout:
        return "timeout"
    except MemoryError:
        return "memory"
    except BaseException:
        return "fail"


def _check(answers, requests):
    report_fd = _os.dup(1)
    _os.dup2(_os.open(_os.devnull, _os.O_WRONLY), 1)  # what the tests print is not the report
    task = json.loads(_sys.stdin.read())
    if _UNDUMPABLE is not None and task["mechanism"] == "rlimits":
        raise _UNDUMPABLE
    timeout = task["timeout"]
    try:
        compile(task["program"], "solution.py", "exec")
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        _write(report_fd, {"syntax_error": True})
        return
    channel = _Channel(answers, requests, task["max_message_bytes"])
    try:
        channel.send({"program": task["program"], "timeout": timeout})
    except RemoteGone:
        pass
    _signal.signal(_signal.SIGALRM, _alarm)
    namespace = {"__name__": "solution"}
    setup = "pass"
    if task["setup"]:
        setup = _run(compile(task["setup"], "setup.py", "exec"), namespace, timeout)
    codes = []
    for index, test in enumerate(task["tests"]):
        try:
            codes.append(compile(test, "test_%d.py" % index, "exec"))
        except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
            codes.append(None)
    stubs = set(_stubs(task["setup"]) if setup == "pass" else ())
    used = set(task["entry_points"]) | stubs
    if setup == "pass":  # a function of the setup with a body of its own that the completion wrote again: the tests
        kept = [n for n in _rewritten(task["setup"], task["program"]) if n not in used]  # call the setup's (said)
        if kept:
            _write(report_fd, {"kept": kept[:64]})
    for code in codes:
        if code is not None:
            used |= {n for n in _names(code) if n not in namespace and not hasattr(_builtins, n)}
    for name in used:
        if not name.startswith("__"):
            namespace[name] = _Remote(name, channel)
    program = channel.program(timeout) if channel.state == "open" else "gone"
    if setup != "pass" and program == "pass":
        program = "fail"
    _write(report_fd, {"program": program})
    for index, code in enumerate(codes):
        result = "fail"
        if program == "pass" and code is not None:
            if channel.waiting is not None and channel.state == "open":
                channel.settle()
            _random.seed(0)
            result = _run(code, namespace, timeout)
        _write(report_fd, {"test": index, "result": result})
    _write(report_fd, {"done": True, "channel": channel.state})


getattr(_sys, "set_int_max_str_digits", lambda digits: None)(0)
_check(int(_sys.argv[1]), int(_sys.argv[2]))
'''
