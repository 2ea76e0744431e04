"""tpserve: a tensor-parallel LLM inference server on Ray (XPU, CUDA, CPU)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import tpserve` stays light for workers and the CLI.
    if name in ("Client", "AsyncClient"):
        from tpserve import client

        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["AsyncClient", "Client", "__version__"]
