"""Starting the server's children by name: the parent spawns them before it imports anything heavy (torch,
transformers, FastAPI), so that their seconds of imports and model loading overlap its own."""

from __future__ import annotations

from cache.shm_store import ShmEmbedReader
from mmserve.ipc.endpoints import Endpoints
from mmserve.launch.config import ServerConfig
from mmserve.launch.processes import ChildProcess, spawn_child
from visual.tower_turn import TowerTurn


def spawn_router(config: ServerConfig, endpoints: Endpoints, shm_prefix: str | None) -> ChildProcess:
    reader = ShmEmbedReader(shm_prefix) if shm_prefix else None
    turn = TowerTurn(shm_prefix) if shm_prefix else None  # used or not as --tower_turn_ms says (Router)
    return spawn_child("router", "mmserve.router.router:run_router_process", config, endpoints, reader, turn)


def spawn_detokenizer(config: ServerConfig, endpoints: Endpoints) -> ChildProcess:
    return spawn_child("detokenizer", "mmserve.detok.process:run_detokenizer_process", config, endpoints)


def spawn_visual(config: ServerConfig, endpoints: Endpoints, shm_prefix: str) -> ChildProcess:
    return spawn_child("visual", "mmserve.prep.visual_link:run_visual_child", config, endpoints, shm_prefix)
