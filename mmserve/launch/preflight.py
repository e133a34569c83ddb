"""What the server checks before it starts any process, so that a mistake in the command line is one clear line and
a non-zero exit within a second, not tracebacks from several processes after seconds of imports: the model folder
(config.json with an architecture served here, tokenizer files) and the HTTP port, which is bound here and handed
to uvicorn once the model has loaded. Light imports only."""

from __future__ import annotations

import json
import os
import socket

from families import architectures, image_architectures
from mmserve.launch.config import ServerConfig
from mmserve.prep.tokenizers.qwen_tiktoken import VOCAB_FILE

# A tokenizer's vocabulary, one of which a checkpoint folder holds (tokenizer_config.json alone names a class).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", VOCAB_FILE)


class CannotStart(Exception):
    """Why the server cannot start, in one line."""


def check_model_dir(config: ServerConfig) -> None:
    """Raise CannotStart unless --model_dir is a checkpoint folder this server can serve as configured."""
    model_dir = config.model_dir
    if not os.path.exists(model_dir):
        raise CannotStart(f"--model_dir {model_dir} does not exist")
    if not os.path.isdir(model_dir):
        raise CannotStart(f"--model_dir {model_dir} is a file: pass the checkpoint's folder")
    architecture = _architecture(model_dir)
    if architecture not in architectures():
        raise CannotStart(f"--model_dir {model_dir}: architecture {architecture!r} is not supported; supported: "
                          f"{', '.join(architectures())}")  # fmt: skip
    if config.enable_multimodal and architecture not in image_architectures():
        raise CannotStart(f"--enable_multimodal: {architecture} has no vision tower here; models with one: "
                          f"{', '.join(image_architectures())}")  # fmt: skip
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES):
        raise CannotStart(f"--model_dir {model_dir} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})")
    remote = _remote_tokenizer_class(model_dir)
    if remote and not config.trust_remote_code:
        raise CannotStart(f"--model_dir {model_dir}: its tokenizer is the checkpoint's own code ({remote}, named in "
                          "tokenizer_config.json's auto_map); pass --trust_remote_code to run it")  # fmt: skip
    source = config.generation_config
    if source not in ("auto", "vllm") and not os.path.isfile(os.path.join(source, "generation_config.json")):
        raise CannotStart(f"--generation_config {source}: no generation_config.json there (auto: the checkpoint's; "
                          "vllm: none)")  # fmt: skip


def _remote_tokenizer_class(model_dir: str) -> str | None:
    """The checkpoint's own tokenizer class (`module.Class`) where transformers can load its tokenizer only by running
    that code (tokenizer_class is the auto_map's class, e.g. InternLM2Tokenizer); None otherwise. Qwen-VL's
    tiktoken folder is read by our own loader instead."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(os.path.join(model_dir, VOCAB_FILE)) or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        refs = config.get("auto_map", {}).get("AutoTokenizer") or []
    except (OSError, ValueError, AttributeError):
        return None  # transformers says what is wrong with it
    refs = [refs] if isinstance(refs, str) else refs
    cls = config.get("tokenizer_class")
    return next((ref for ref in refs if isinstance(ref, str) and cls and ref.endswith("." + cls)), None)


def _architecture(model_dir: str) -> str:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CannotStart(f"--model_dir {model_dir} has no config.json: not a Hugging Face checkpoint folder")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        architectures = raw["architectures"]
        if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
            raise TypeError("not a list of names")
    except (OSError, ValueError) as e:
        raise CannotStart(f"{path} cannot be read: {e}") from None
    except (KeyError, TypeError):
        raise CannotStart(f'{path} names no architectures (e.g. "architectures": ["LlamaForCausalLM"])') from None
    return architectures[0]


def bind_http_sockets(host: str, port: int) -> list[socket.socket]:
    """The HTTP server's sockets, bound now (uvicorn listens on them once the model has loaded): a port already in
    use or an address not of this host is found before anything loads. One per address `host` resolves to
    (`localhost`: 127.0.0.1 and ::1), as uvicorn binds them itself. Raises CannotStart."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CannotStart(f"--host {host}: {e.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # each address once
            sockets.append(_bound_socket(family, kind, proto, address))
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise CannotStart(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sockets


def _bound_socket(family: int, kind: int, proto: int, address: tuple) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over connections in TIME_WAIT
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its IPv4 twin has its own socket
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
