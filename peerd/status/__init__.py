"""What an owner sees of a running node: ``peerd status``'s text, ``peerd top``, and the status page."""
