"""Errors a user of `vkubelet dev cluster` can act on; the CLI prints their message and exits 1."""


class DevClusterError(Exception):
    pass
