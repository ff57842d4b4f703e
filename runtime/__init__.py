"""The step loop and what drives it: the reference generate loop, backends, policies, metrics."""
