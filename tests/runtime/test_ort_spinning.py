"""OrtBackend's `spinning`: its sessions' intra-op threads spin after a run unless told not to (a
benchmark that times torch between ONNX Runtime's runs turns it off)."""

from __future__ import annotations

import pytest

SPINNING = "session.intra_op.allow_spinning"


def spins(session) -> bool:
    try:
        return session.get_session_options().get_session_config_entry(SPINNING) != "0"
    except RuntimeError:  # no entry: ONNX Runtime's default, which spins
        return True


@pytest.mark.parametrize("spinning, expected", [(None, True), (False, False), (True, True)])
def test_a_mask_models_sessions_spin_unless_told_not_to(tiny_export, spinning, expected):
    from dlmrt.runtime.ort_backend import OrtBackend

    backend = OrtBackend(tiny_export, spinning=spinning)
    assert backend.sessions and all(spins(session) == expected for session in backend.sessions.values())
