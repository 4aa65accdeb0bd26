"""The ``pc-rag bench`` benchmarks, one module each: ``ttft``, ``peers``, ``memory``, ``encode``, ``codec``,
``link`` and ``serve``. Each prints a table and writes JSON; none is imported by the engine."""
