/* Frame mode's pseudo-terminal (--tty, the 'x' payload's terminal field): its master is the
 * supervisor's alone; the slave is the command's. */
#ifndef DSH_PTY_H
#define DSH_PTY_H

#include <stddef.h>

/* "R<SEP>C" in N bytes, each a decimal number from 1 to 65535: 0 when sound. */
int parse_size(const char *s, size_t n, char sep, unsigned short *rows, unsigned short *cols);
/* Makes the terminal and names its slave in SLAVE; *IN_FD and *OUT_FD get dups of the master (the
 * 'i' queue's and the 'o' stream's, which close on their own). 0, or the errno that failed it. */
int pty_open(unsigned short rows, unsigned short cols, char *slave, size_t size, int *in_fd, int *out_fd);
int pty_active(void);
/* 'W': TEXT (LEN bytes, counted past the CAP bytes kept) is the new size "R C". */
void pty_resize(const unsigned char *text, size_t len, size_t cap);

#endif
