"""The `voicemesh` command: serve a service, start the local mesh, and talk to each service from a shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from voicemesh import console, observe
from voicemesh.audio import read_wav, write_wav
from voicemesh.clients import Credentials
from voicemesh.mesh import DEFAULT_PORTS, Mesh, free_port, wait_healthy
from voicemesh.tls import ClientTls, local_certificates

SERVICES = ("asr", "llm", "tts", "gateway")


def _serve(argv: Sequence[str]) -> None:
    if not argv or argv[0] not in SERVICES:
        raise SystemExit(f"usage: voicemesh serve {{{','.join(SERVICES)}}} [--flags]")
    name, rest = argv[0], list(argv[1:])
    if name == "asr":
        from services.asr.server import main
    elif name == "llm":
        from services.llm.server import main
    elif name == "tts":
        from services.tts.server import main
    else:
        from gateway.server import main
    main(rest)


def positive_int(raw: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


async def _up(args: argparse.Namespace) -> None:
    """The whole mesh on loopback until Ctrl-C or SIGTERM. On a terminal it prints a line per turn and problem;
    the services' JSON logs go to --log-dir (on the terminal instead with --json-logs, or when not a TTY)."""
    human = sys.stdout.isatty() and not args.json_logs
    log_dir: str | None = args.log_dir or (tempfile.mkdtemp(prefix="voicemesh-logs-") if human else None)
    mesh = Mesh(log_dir=log_dir)
    ports = {"asr": args.asr_port, "llm": args.llm_port, "tts": args.tts_port, "gateway": args.gateway_port}
    observers = observe.Observers(args.prometheus_port, args.otlp_port) if args.observe else None
    metrics_ports = {name: free_port() for name in ports} if observers else None
    observe_env = observers.before_mesh() if observers else {}
    certs, service_token = None, ""
    if args.tls:  # TLS on every hop, mutual to the services, which also want a token; the CA is printed
        certs = local_certificates(Path(tempfile.mkdtemp(prefix="voicemesh-tls-")))
        service_token = secrets.token_urlsafe(24)
    # What was heard and replied goes into the gateway's turn log only here, for the person at the terminal.
    gateway_args = ["--log-transcripts=true"] if human else []
    mesh.start_local(ports, args.http_port, gateway_args, certs, service_token, args.cpus, metrics_ports, observe_env)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):  # a supervisor's SIGTERM stops the children too
        loop.add_signal_handler(signum, stop.set)
    print("starting ASR, LLM, TTS and the gateway, each its own process (models load in a few seconds)...", flush=True)
    try:
        await mesh.wait()
        if observers and metrics_ports:
            scrapes = [
                observe.Target(name, f"127.0.0.1:{port}", "" if name == "gateway" else service_token)
                for name, port in metrics_ports.items()
            ]
            await asyncio.to_thread(observers.after_mesh, scrapes)
        scheme, tls_flag = ("https", f" --tls-ca {certs.ca_file}") if certs else ("http", "")
        print(
            f"web page:    {scheme}://localhost:{args.http_port}/  (microphone; WebRTC with WebSocket fallback)\n"
            f"talk to it:  voicemesh talk ../shared/audio/jfk.wav --out reply.wav "
            f"--target localhost:{ports['gateway']}{tls_flag}\n"
            f"services:    {', '.join(f'{name} 127.0.0.1:{port}' for name, port in ports.items())} "
            f"(gRPC{', TLS' if certs else ''}, SERVING)\n"
            + (f"TLS:         CA {certs.ca_file} (trust it in the browser to use the page)\n" if certs else "")
            + (f"logs:        {log_dir}/{{asr,llm,tts,gateway}}.log (JSON)\n" if log_dir else "")
            + "".join(f"{line}\n" for line in (observers.lines if observers else []))
            + "Ctrl-C stops everything.\n",
            flush=True,
        )
        watchers = [asyncio.ensure_future(_watch_children(mesh, stop))]
        if human and log_dir:
            watchers.append(asyncio.ensure_future(_print_events(Path(log_dir), stop)))
        await stop.wait()
        await asyncio.gather(*watchers)
    finally:
        mesh.stop_all()
        if observers:
            observers.stop()
        print("stopped.", flush=True)


async def _watch_children(mesh: Mesh, stop: asyncio.Event) -> None:
    while not stop.is_set():
        dead = [p for p in mesh.processes.values() if p.popen.poll() is not None]
        if dead:
            for process in dead:
                print(f"{process.name} exited with {process.popen.returncode}; stopping the mesh", file=sys.stderr)
                if mesh.log_dir:
                    for line in console.tail(Path(mesh.log_dir) / f"{process.name}.log", 5):
                        print(f"  {line}", file=sys.stderr)
            stop.set()
            return
        await asyncio.sleep(0.5)


async def _print_events(log_dir: Path, stop: asyncio.Event) -> None:
    paths = {name: log_dir / f"{name}.log" for name in SERVICES}
    async for service, record in console.follow(paths, stop):
        line = console.human_line(service, record)
        if line is not None:
            print(line, flush=True)


async def _transcribe(args: argparse.Namespace) -> int:
    from voicemesh import clients

    clip = read_wav(args.clip)
    finals = []
    credentials = _credentials(args)
    async for seconds, event in clients.recognize(
        args.target, clip, args.rate, realtime=not args.fast, credentials=credentials
    ):
        kind = event.WhichOneof("event")
        if args.json:
            print(
                json.dumps(
                    {
                        "t_s": round(seconds, 3),
                        "turn": event.turn_index,
                        "event": kind,
                        "text": getattr(getattr(event, kind), "text", ""),
                        "queue_ms": round(event.timing.queue_ms, 1),
                        "compute_ms": round(event.timing.compute_ms, 1),
                    }
                )
            )
        elif kind in ("partial", "final", "endpoint_candidate"):
            print(f"{seconds:6.2f}s  {kind:<18} {getattr(event, kind).text}")
        if kind == "final":
            finals.append(event.final.text)
    if not args.json:
        print(" ".join(finals))
    return 0


async def _ask(args: argparse.Namespace) -> int:
    import time

    from voicemesh import clients
    from voicemesh.v1 import llm_pb2

    start = time.monotonic()
    first_ms = None
    text = []
    async for response in clients.generate(
        args.target, [(llm_pb2.ROLE_USER, args.question)], max_tokens=args.max_tokens, credentials=_credentials(args)
    ):
        if first_ms is None:
            first_ms = (time.monotonic() - start) * 1000
        text.append(response.text_delta)
        if not args.json:
            print(response.text_delta, end="", flush=True)
        if response.finish_reason:
            usage = response.usage
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(text),
                    "first_token_ms": round(first_ms or 0, 1),
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                }
            )
        )
    else:
        print()
    return 0


async def _say(args: argparse.Namespace) -> int:
    from voicemesh import clients

    audio = bytearray()
    first_s = None
    async for seconds, event in clients.synthesize(
        args.target, args.text.split(" "), rate_hz=args.rate, credentials=_credentials(args)
    ):
        if event.WhichOneof("event") == "audio":
            first_s = seconds if first_s is None else first_s
            audio += event.audio.frame.data
    write_wav(args.out, bytes(audio), args.rate)
    summary = {
        "out": args.out,
        "audio_s": round(len(audio) / 2 / args.rate, 3),
        "first_audio_ms": round((first_s or 0) * 1000, 1),
    }
    print(json.dumps(summary) if args.json else f"wrote {args.out}: {summary['audio_s']} s of audio")
    return 0


async def _talk(args: argparse.Namespace) -> int:
    from voicemesh.conversation import SessionError, talk
    from voicemesh.v1 import conversation_pb2

    config = conversation_pb2.SessionConfig(
        session_id=args.session_id, input_sample_rate_hz=16000, output_sample_rate_hz=16000
    )
    turns, audio, events = await talk(
        args.target, read_wav(args.clip), config, trailing_silence_s=args.silence, credentials=_credentials(args)
    )
    for event in events:
        if isinstance(event, SessionError):
            print(f"error in {event.stage}: {event.code}: {event.message}", file=sys.stderr)
    if args.out:
        write_wav(args.out, audio, 16000)
    if args.json:
        print(
            json.dumps({"turns": [t.as_dict() for t in turns], "reply_audio_s": round(len(audio) / 32000, 2)}, indent=2)
        )
        return 0
    for turn in turns:
        print(f"turn {turn.turn_index}: you said {turn.user_text!r}")
        print(f"         reply {turn.reply_text!r}{' (interrupted)' if turn.interrupted else ''}")
        stages = ", ".join(f"{name} {value_ms:.0f}" for name, value_ms in turn.stages_ms.items())
        v2v = "-" if turn.v2v_ms is None else f"{turn.v2v_ms:.1f}"
        print(f"         V2V {v2v} ms  [{stages}]")
    if args.out:
        print(f"wrote {args.out}: {len(audio) / 32000:.1f} s of reply audio")
    return 0


async def _report(args: argparse.Namespace) -> int:
    from voicemesh import report

    if args.listen:
        spans = await report.collect(args.listen, args.seconds)
    elif args.files:
        spans = report.read_jsonl(args.files)
    else:
        print("give JSONL span files or --listen HOST:PORT", file=sys.stderr)
        return 2
    summary = report.summarize_turns(spans)
    print(json.dumps(summary.to_json(), indent=2) if args.json else report.format_table(summary))
    return 0


async def _health(args: argparse.Namespace) -> int:
    try:
        await wait_healthy(args.target, args.timeout)
    except TimeoutError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{args.target} SERVING")
    return 0


async def _loadtest(args: argparse.Namespace) -> int:
    from voicemesh.loadtest import command

    return await command(args, _credentials(args))


async def _token(args: argparse.Namespace) -> int:
    from voicemesh.auth import issue_token

    keys = os.environ.get("VOICEMESH_JWT_KEYS", "")
    if not keys:
        print("set VOICEMESH_JWT_KEYS (kid:secret[,kid:secret]), the keys the gateway verifies with", file=sys.stderr)
        return 2
    print(issue_token(keys, args.subject, args.ttl_s, args.key_id, args.audience))
    return 0


def _connection_flags() -> argparse.ArgumentParser:
    """The flags every client command shares: TLS and a bearer token."""
    flags = argparse.ArgumentParser(add_help=False)
    group = flags.add_argument_group("connection")
    group.add_argument("--token", default=None, help="bearer token or JWT (default: $VOICEMESH_TOKEN)")
    group.add_argument("--tls", action="store_true", help="TLS, checking the server against the system's CAs")
    group.add_argument("--tls-ca", default="", help="TLS, checking the server against this PEM CA")
    group.add_argument("--tls-cert", default="", help="client certificate (PEM) for mutual TLS")
    group.add_argument("--tls-key", default="", help="the client certificate's key (PEM)")
    return flags


def _credentials(args: argparse.Namespace) -> Credentials:
    token = args.token if args.token is not None else os.environ.get("VOICEMESH_TOKEN", "")
    use_tls = args.tls or args.tls_ca or args.tls_cert
    return Credentials(ClientTls(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None, token)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        _serve(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="voicemesh", description="Low-latency voice AI over a gRPC mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    connection = _connection_flags()
    sub.add_parser("serve", help="run one service: voicemesh serve {asr,llm,tts,gateway} --help")

    up = sub.add_parser("up", help="start ASR, LLM, TTS and the gateway on loopback; print a line per turn")
    up.add_argument("--asr-port", type=int, default=DEFAULT_PORTS["asr"])
    up.add_argument("--llm-port", type=int, default=DEFAULT_PORTS["llm"])
    up.add_argument("--tts-port", type=int, default=DEFAULT_PORTS["tts"])
    up.add_argument("--gateway-port", type=int, default=DEFAULT_PORTS["gateway"])
    up.add_argument("--http-port", type=int, default=8080, help="the gateway's web page and browser doors")
    up.add_argument(
        "--log-dir", default=None, help="write each service's JSON logs here (default on a terminal: a temp dir)"
    )
    up.add_argument("--json-logs", action="store_true", help="the services' JSON logs on the terminal, not a summary")
    up.add_argument("--tls", action="store_true", help="TLS on every hop (a throwaway CA; mutual TLS to the services)")
    up.add_argument(
        "--observe",
        action="store_true",
        help="also start Prometheus (the chart's rules) and an OpenTelemetry collector where installed; prints where to look",
    )
    up.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus's web port with --observe")
    up.add_argument("--otlp-port", type=int, default=4317, help="the collector's OTLP/gRPC port with --observe")
    up.add_argument(
        "--cpus",
        type=positive_int,
        default=None,
        help="cores the mesh may use; each engine's threads are derived from it (default: this process's cores)",
    )

    tr = sub.add_parser("transcribe", parents=[connection], help="stream a WAV into the ASR service")
    tr.add_argument("clip")
    tr.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['asr']}")
    tr.add_argument("--rate", type=int, default=16000, choices=(16000, 48000), help="rate to send at")
    tr.add_argument("--fast", action="store_true", help="send as fast as possible, not at real-time pace")
    tr.add_argument("--json", action="store_true")

    ask = sub.add_parser("ask", parents=[connection], help="ask the LLM service a question")
    ask.add_argument("question")
    ask.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['llm']}")
    ask.add_argument("--max-tokens", type=int, default=0)
    ask.add_argument("--json", action="store_true")

    say = sub.add_parser("say", parents=[connection], help="synthesize text with the TTS service into a WAV")
    say.add_argument("text")
    say.add_argument("--out", required=True)
    say.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['tts']}")
    say.add_argument("--rate", type=int, default=22050)
    say.add_argument("--json", action="store_true")

    talk = sub.add_parser(
        "talk", parents=[connection], help="speak a WAV to the gateway in real time; save the reply; print V2V per turn"
    )
    talk.add_argument("clip")
    talk.add_argument("--out", default=None, help="write the reply audio here (WAV)")
    talk.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['gateway']}")
    talk.add_argument("--session-id", default="")
    talk.add_argument("--silence", type=float, default=4.0, help="seconds of silence streamed after the clip")
    talk.add_argument("--json", action="store_true")

    token = sub.add_parser("token", help="sign a JWT for a subject with $VOICEMESH_JWT_KEYS (tests, scripts)")
    token.add_argument("--subject", required=True, help="who the token speaks for (a user id)")
    token.add_argument("--ttl-s", type=float, default=3600.0, help="seconds until it expires")
    token.add_argument("--key-id", default="", help="kid of the key to sign with (default: the last, newest)")
    token.add_argument("--audience", default="", help="aud claim, if the gateway checks one")

    report = sub.add_parser("report", help="p50/p95/p99/max of V2V and every stage, from spans")
    report.add_argument("files", nargs="*", help="JSONL span files (the services' --trace-file)")
    report.add_argument("--listen", default="", help="run an OTLP/gRPC receiver here instead, e.g. 127.0.0.1:4317")
    report.add_argument("--seconds", type=float, default=60.0, help="how long the receiver collects")
    report.add_argument("--json", action="store_true")

    health = sub.add_parser("health", help="exit 0 once a service reports SERVING")
    health.add_argument("--target", required=True)
    health.add_argument("--timeout", type=float, default=3.0)

    load = sub.add_parser(
        "loadtest",
        parents=[connection],
        help="N concurrent sessions of real speech against a gateway: V2V p50/p95/p99 per stage, HTML report",
    )
    # Flags left out are None: the defaults live in voicemesh.loadtest (LoadTestOptions, DEFAULT_BUDGET_MS).
    load.add_argument(
        "--target",
        help="gateway HOST:PORT: its gRPC port, or its HTTP door with --transport ws, twilio or realtime (default: `voicemesh up`'s, "
        "127.0.0.1:50051); an empty one (--target '') starts a local mesh for the test and stops it after",
    )
    load.add_argument("--sessions", type=int, help="concurrent sessions")
    load.add_argument("--turns", type=int, help="turns (clips spoken) per session")
    load.add_argument("--audio", nargs="+", required=True, help="16-bit WAV files or directories of them")
    load.add_argument(
        "--transport",
        help="grpc (Conversation.Converse), ws (the WebSocket door browsers use), twilio (phone calls as Twilio places "
        "them; the carrier signs with VOICEMESH_GATEWAY_TWILIO_AUTH_TOKEN) or realtime (the OpenAI Realtime door)",
    )
    load.add_argument("--ramp-s", type=float, help="spread session starts over this many seconds")
    load.add_argument(
        "--arrival", choices=("staggered", "sync"), help="sync: every session speaks each turn at once (worst case)"
    )
    load.add_argument("--think-s", help="think time between a reply and the next clip: SECONDS or LOW,HIGH (seeded)")
    load.add_argument("--duration-s", type=float, help="hard time limit for the whole test")
    load.add_argument("--turn-timeout-s", type=float, help="a reply not done this long after its clip fails")
    load.add_argument(
        "--out", default=None, help="directory for the JSON and HTML report (default loadtest-results/TIME)"
    )
    load.add_argument("--sweep", default="", help="session counts, e.g. 1,2,4,8: find the largest within --budget-ms")
    load.add_argument("--budget-ms", type=float, help="p99 V2V budget for --sweep")
    load.add_argument("--sweep-all", action="store_true", help="run every --sweep level, even past the budget")
    load.add_argument("--allow-remote", action="store_true", help="allow a target that is not a loopback address")

    args = parser.parse_args(argv)
    handlers = {
        "up": _up,
        "transcribe": _transcribe,
        "ask": _ask,
        "say": _say,
        "talk": _talk,
        "report": _report,
        "health": _health,
        "loadtest": _loadtest,
        "token": _token,
    }
    try:
        code = asyncio.run(handlers[args.command](args))
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # a person reads this: one line, not a traceback
        import grpc

        if isinstance(exc, grpc.aio.AioRpcError):
            print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            code = 2
        else:
            raise
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
