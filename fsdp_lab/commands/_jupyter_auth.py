"""Imported by the Jupyter server that `fsdp-lab lab` starts, never by fsdp-lab itself (it needs jupyter_server).

The launcher names this class on Jupyter's command line (`--ServerApp.identity_provider_class=...`), which
outranks every config file, and hands the token over in JUPYTER_TOKEN, which `ps` does not show to other
users. See [Note: token auth] in fsdp_lab.commands.lab.
"""
from __future__ import annotations

import os

from jupyter_server.auth.identity import PasswordIdentityProvider
from traitlets import validate

TOKEN_ENV = "JUPYTER_TOKEN"


class LauncherTokenIdentityProvider(PasswordIdentityProvider):
    """Jupyter's default identity provider (token, or a configured password as well), except that the token
    is always the launcher's: `c.IdentityProvider.token = ''` in a config file cannot switch it off."""

    @validate("token")
    def _keep_the_launchers_token(self, proposal):
        return os.environ.get(TOKEN_ENV) or proposal["value"]
