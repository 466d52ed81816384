"""A torch dispatch mode that records every operator call reaching it (torch imported on use)."""


def recording_mode(args_of=None):
    """calls: the name of every operator that reaches the mode; with args_of (an operator name such as
    "tessera.conv2d.default"), the positional arguments of each call of that operator instead."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if args_of is None:
                self.calls.append(str(func))
            elif str(func) == args_of:
                self.calls.append(args)
            return func(*args, **(kwargs or {}))

    return Recorder()
