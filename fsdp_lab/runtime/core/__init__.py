"""The core both front ends share: units, streams, collectives, the layout seam, state, root, mixed precision."""
