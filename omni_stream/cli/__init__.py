"""The command line: ``omni-stream generate | serve | models | bench``.

Exit status: 0 done; 1 the run failed (the model raised, the engine died,
a file could not be written); 2 bad arguments or params; 130 interrupted.
Every error is one line on stderr, never a traceback.

.. code-block:: text

    command.py   main and entry: parse, dispatch, the exit status; bench
    parser.py    every command's options (argparse), checked as they are parsed
    console.py   what a user reads on stderr: one-line errors, the library's log records
    progress.py  ProgressBar: step/total, steps/s and ETA on one line
    loader.py    ModelLoader: the model a SPEC names, with the command's options
                 (a value: serve --ray pickles it to every replica); --model-config
    loras.py     the LoRAs named: for every model that takes them, or bound to one
    model_dir.py serve --model-dir: a checkpoint folder, a model per file
    generate.py  generate: one request, its previews and its result written
    models.py    models: the models and their params, listed
    serve.py     serve: the models, here or on Ray replicas, behind the server
"""

from __future__ import annotations

from ..config import TOKEN_ENV
from .command import entry, main
from .parser import build_parser
from .progress import ProgressBar

# TOKEN_ENV (config.py's) is re-exported: cli.TOKEN_ENV is where it was first defined.
__all__ = ["main", "entry", "build_parser", "ProgressBar", "TOKEN_ENV"]
