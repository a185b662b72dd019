"""The command line: `shardplan plan | explain | diff | check | calibrate | demo | train`."""
