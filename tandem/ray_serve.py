"""The import path Ray Serve configs name: `serve run tandem.ray_serve:build`, `import_path: tandem.ray_serve:build`
(the application itself is tandem.runtimes.ray_serve)."""

from tandem.runtimes.ray_serve import build

__all__ = ["build"]
