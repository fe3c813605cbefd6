"""L4: the serving processes — OpenAI gateway, Conductor service, prefill / decode /
coupled workers — their control-plane protocol and the launcher."""
