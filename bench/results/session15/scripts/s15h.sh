#!/usr/bin/env bash
# Session 15, call 8: timelines of streamed SplitZip transfers (1 GiB and 256 MiB unpaced) at the tree.
TL_RUNS='run tl_1g --backend ucxx --sizes 1G --repeats 6 --codecs splitzip; run tl_256m --backend ucxx --sizes 256M --repeats 10 --codecs splitzip' bash bench/.prof/tl.sh
