"""Plugins that get the hook wrong, selected by the entry point's attribute."""

from __future__ import annotations

import vt


class RaisesInHook:
    @vt.hookimpl
    def vt_register_backends(self, register):
        raise ValueError("cannot enumerate devices")


class MisspelledHook:
    @vt.hookimpl
    def vt_register_backend(self, register):  # typo: pluggy's check_pending catches it
        pass


class RegistersJunk:
    @vt.hookimpl
    def vt_register_backends(self, register):
        register("not a class")


class RegistersNothing:
    @vt.hookimpl
    def vt_register_backends(self, register):
        pass


class NoHook:
    pass


raises_in_hook = RaisesInHook()
misspelled_hook = MisspelledHook()
registers_junk = RegistersJunk()
registers_nothing = RegistersNothing()
no_hook = NoHook()
