"""The models pipeclock trains, built stage by stage: only a rank's own layers are ever allocated."""
