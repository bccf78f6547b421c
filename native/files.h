/* files.c: --read-file and --write-file, a file moved as this process's user (version 9). */
#ifndef DSH_FILES_H
#define DSH_FILES_H

/* The whole of the mode: ARGV holds its options only; returns the exit status. */
int run_file_mode(int argc, char **argv);

#endif
