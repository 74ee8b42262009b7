"""Reading a YAML settings file into a pydantic model, with every problem as one ConfigError line
that names the file (PolarEnv configs, slime recipes, training recipes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from polar_env.errors import ConfigError
from polar_env.registry import validation_line

M = TypeVar("M", bound=BaseModel)


def read_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """The file's top-level mapping (empty for an empty file)."""
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {file} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {file}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {file} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {file} must be a mapping of settings, got {type(data).__name__}")
    return data


def validated(model: type[M], data: dict[str, Any], path: str | Path, what: str) -> M:
    """``model`` built from ``data``; the first validation problem becomes the error line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{what} {path}: {validation_line(exc, model=model)}") from None


def load_model(model: type[M], path: str | Path, what: str) -> M:
    return validated(model, read_mapping(path, what), path, what)
