"""Stable content hashes of specs, to tie plans, runs and calibrations to their inputs."""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel


def canonical_json(model: BaseModel) -> str:
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def spec_sha256(model: BaseModel) -> str:
    return hashlib.sha256(canonical_json(model).encode()).hexdigest()
