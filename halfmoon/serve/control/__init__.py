"""The control plane: the signed wire format, its typed messages, and the Conductor
service process that answers them."""
