/* Frame mode's output: frames (a type byte, a 4-byte big-endian length, the payload) queued in a
 * bounded ring and written non-blocking to fd 1, or to the side pipe once the harness switched. */
#ifndef DSH_FRAMES_H
#define DSH_FRAMES_H

#include <stddef.h>

#define FRAME_HEADER 5
#define OUT_LIMIT (256 * 1024)   /* buffered output at which the command's pipes are no longer read */
#define RECORD_ROOM 16384        /* beyond it, for records a command can provoke (signalled, warning,
                                    input drained, input waiting / busy) */
#define FINAL_ROOM 1024          /* kept for the once-only ones: started, exit, EOF frames, empty,
                                    pipe, switch, nonce, input broken, the first input busy */
#define RING_CAP (OUT_LIMIT + FRAME_HEADER + READ_SIZE + RECORD_ROOM + FINAL_ROOM)
#define NONCE_MAX 64             /* bytes of the nonce a 'G' carries that count */

struct stream {
    int fd;                /* the supervisor's read end of the command's pipe, -1 once at EOF */
    char type;
    long long budget;      /* once no child is left: bytes still to read (what the pipe held then) */
};

/* GONE is called once writing failed: nobody reads, the harness is gone. */
void frames_init(void (*gone)(void));
int frame_out(char type, const void *data, size_t n, size_t limit);
void flush_out(void);
int read_stream(struct stream *s, size_t max);
size_t frames_queued(void); /* bytes waiting to be written */
int frames_dead(void);      /* writing failed: output is dropped from now on */
int out_fd(void);
void side_offer(void);
void side_switch(const unsigned char *nonce, size_t n, const struct stream streams[2]);

#endif
