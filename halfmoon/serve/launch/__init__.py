"""Starting clusters: ``halfmoon serve`` on one machine, and a served cluster as a child
process for tests and evaluation scripts."""
