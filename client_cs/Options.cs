using System;
using System.Collections.Generic;
using System.Globalization;
using System.IO;
using System.Linq;
using System.Net;
using System.Text;

namespace ChatCli
{
    /// <summary>Command-line options, with defaults taken from the environment.</summary>
    public sealed class Options
    {
        public const string DefaultUrl = "http://localhost:7071/api/chat";

        public string Url;
        public string Key;
        public string CallerKey;   // --caller-key KEY: sent as Authorization: Bearer KEY
        public string System;
        public string Model;
        public bool Stats;
        public bool AllowInsecureKey;
        public bool Help;
        public string Prompt;
        public string Resume;      // --resume ID: continue that stream instead of sending a prompt
        public long LastEventId;   // --last-event-id N: with --resume, from after event N
        public int Retries = 5;    // --retries N: reconnection attempts in a row

        public const string Usage =
@"usage: chat [--url URL] [--key KEY] [--caller-key KEY] [--system TEXT] [--model NAME]
            [--stats] [--retries N] [--allow-insecure-key] PROMPT...
       chat --resume ID [--last-event-id N] [--url URL] [--key KEY] [--caller-key KEY]
            [--stats] [--retries N] [--allow-insecure-key]

Sends PROMPT to the chat endpoint and prints the reply as it streams in.
The words of PROMPT are joined with single spaces. With no PROMPT words and
standard input redirected, the prompt is read from standard input.

When the app makes the stream resumable (RESUMABLE_STREAMS=on: it answers with
an x-stream-id header), a connection that drops before the last event is opened
again with Last-Event-ID, so the reply is printed exactly once; Ctrl+C asks the
app to cancel the stream.

options:
  --url URL       endpoint to POST to (env CHAT_URL, default " + DefaultUrl + @")
  --key KEY       function key, sent as the x-functions-key header (env FUNCTION_KEY);
                  over plain http:// only to a loopback address (localhost, 127.x.x.x, ::1)
  --caller-key KEY
                  caller key (the app's CALLER_KEYS=required), sent as the header
                  Authorization: Bearer KEY on every request, resumes and cancel included
                  (env CALLER_KEY); over plain http:// only to a loopback address, like --key.
                  Both keys may be given
  --allow-insecure-key
                  send the keys over plain http:// to another host anyway (they travel
                  in clear text)
  --system TEXT   add a system message; the request then carries ""messages""
                  (system + user) instead of ""prompt""
  --model NAME    ask for a specific model
  --stats         print timings, delta count, finish reason and token usage to stderr,
                  and each lost connection and reconnection as it happens
  --retries N     reconnection attempts in a row before giving up (default 5, 0 to 100;
                  waits 0.5, 1, 2, 4, 8 s before them); an attempt that brings new
                  events starts the count again
  --resume ID     continue the resumable stream ID (from a run that was cut off, which
                  prints its id) instead of sending a prompt: print it from the start
  --last-event-id N
                  with --resume: print only what comes after event N
  -h, --help      show this help and exit 0
  --              end of options; everything after it is prompt text
Options may also be written --name=VALUE.

stdout receives exactly the model's text followed by one newline (UTF-8, no BOM).
Diagnostics go to stderr.

exit codes:
  0    the reply finished normally (event: done)
  1    the stream ended with an error event, or ended without done/error (and
       could not be resumed), or the app cancelled it (finish reason cancelled)
  2    the server answered with an HTTP error status before the stream (404 for
       --resume: an unknown or expired stream; 401: no caller key or a wrong
       one), or a key was not sent: plain http:// to a host that is not
       loopback (nothing was sent)
  3    could not connect to the server
  64   bad command-line arguments (EX_USAGE)
  130  cancelled with Ctrl+C (the HTTP request is aborted; a resumable stream is
       cancelled with POST streams/ID/cancel)
  141  stdout was closed by its reader, e.g. `chat ... | head -1` (the request is aborted)";

        /// <summary>Thrown for bad command-line arguments; Program maps it to exit code 64.</summary>
        public sealed class UsageException : Exception
        {
            public UsageException(string message) : base(message) { }
        }

        /// <summary>
        /// Parses the arguments. <paramref name="env"/> looks up environment variables and
        /// <paramref name="stdin"/> supplies redirected standard input (null when stdin is a terminal).
        /// </summary>
        public static Options Parse(string[] args, Func<string, string> env, Func<string> stdin)
        {
            var o = new Options();
            o.Url = NonEmpty(env("CHAT_URL")) ?? DefaultUrl;
            o.Key = NonEmpty(env("FUNCTION_KEY"));
            o.CallerKey = NonEmpty(env("CALLER_KEY"));
            var words = new List<string>();
            bool optionsEnded = false;
            bool lastEventIdGiven = false;

            for (int i = 0; i < args.Length; i++)
            {
                string a = args[i];
                if (optionsEnded || a == "-" || !a.StartsWith("-", StringComparison.Ordinal))
                {
                    words.Add(a);
                    continue;
                }
                if (a == "--") { optionsEnded = true; continue; }

                string name = a;
                string inlineValue = null;
                int eq = a.IndexOf('=');
                if (a.StartsWith("--", StringComparison.Ordinal) && eq > 2)
                {
                    name = a.Substring(0, eq);
                    inlineValue = a.Substring(eq + 1);
                }

                switch (name)
                {
                    case "-h":
                    case "--help":
                        if (inlineValue != null) throw new UsageException("--help takes no value");
                        o.Help = true;
                        break;
                    case "--stats":
                        if (inlineValue != null) throw new UsageException("--stats takes no value");
                        o.Stats = true;
                        break;
                    case "--allow-insecure-key":
                        if (inlineValue != null) throw new UsageException("--allow-insecure-key takes no value");
                        o.AllowInsecureKey = true;
                        break;
                    case "--url":
                        o.Url = TakeValue(args, ref i, name, inlineValue);
                        break;
                    case "--key":
                        o.Key = TakeValue(args, ref i, name, inlineValue);
                        break;
                    case "--caller-key":
                        o.CallerKey = TakeValue(args, ref i, name, inlineValue);
                        break;
                    case "--system":
                        o.System = TakeValue(args, ref i, name, inlineValue);
                        break;
                    case "--model":
                        o.Model = TakeValue(args, ref i, name, inlineValue);
                        break;
                    case "--resume":
                        o.Resume = TakeValue(args, ref i, name, inlineValue);
                        if (!ChatClient.IsStreamId(o.Resume))
                            throw new UsageException("--resume needs a stream id (the x-stream-id of a resumable stream): " + o.Resume);
                        break;
                    case "--last-event-id":
                        o.LastEventId = TakeNumber(args, ref i, name, inlineValue, 0, 999999999999999L);
                        lastEventIdGiven = true;
                        break;
                    case "--retries":
                        o.Retries = (int)TakeNumber(args, ref i, name, inlineValue, 0, 100);
                        break;
                    default:
                        // The name only: the value of a mistyped --name=VALUE may be a key.
                        throw new UsageException("unknown option: " + name);
                }
            }

            if (o.Help) return o;

            // It goes into a header as it is: no empty key, no spaces or control characters (which
            // could end the header). The message never shows the key.
            if (o.CallerKey != null && !IsHeaderToken(o.CallerKey))
                throw new UsageException("--caller-key (or CALLER_KEY) must be a non-empty key of printable " +
                                         "ASCII characters without spaces");

            Uri uri;
            if (!Uri.TryCreate(o.Url, UriKind.Absolute, out uri) ||
                (uri.Scheme != "http" && uri.Scheme != "https"))
                throw new UsageException("--url must be an absolute http:// or https:// URL: " + o.Url);

            if (lastEventIdGiven && o.Resume == null) throw new UsageException("--last-event-id goes with --resume");
            if (o.Resume != null)
            {
                // The stream has its prompt already; stdin is not read.
                if (words.Count > 0 || o.System != null || o.Model != null)
                    throw new UsageException("--resume continues a stream: it takes no prompt, --system or --model");
                return o;
            }

            if (words.Count > 0)
            {
                o.Prompt = string.Join(" ", words);
            }
            else
            {
                string text = stdin == null ? null : stdin();
                // A trailing line break is how `echo hi | chat` ends its input, not part of the prompt.
                if (text != null) text = text.TrimEnd('\r', '\n');
                o.Prompt = text;
            }
            if (string.IsNullOrWhiteSpace(o.Prompt))
                throw new UsageException("no prompt given (pass PROMPT words or pipe the prompt on stdin)");
            return o;
        }

        /// <summary>
        /// True when a function key sent to <paramref name="url"/> would cross a network in clear
        /// text: plain http:// to a host that is not a loopback address. Decided from the URL alone,
        /// before any name lookup, so a refused key never causes traffic.
        /// </summary>
        public static bool KeyWouldTravelInClear(Uri url)
        {
            return url.Scheme == Uri.UriSchemeHttp && !IsLoopbackHost(url);
        }

        /// <summary>Printable ASCII without spaces: what a key may be to go into a header as it is.</summary>
        static bool IsHeaderToken(string s)
        {
            return s.Length > 0 && s.All(c => c > ' ' && c < (char)127);
        }

        /// <summary>localhost, 127.0.0.0/8 and ::1 (also written as ::ffff:127.x.x.x).</summary>
        public static bool IsLoopbackHost(Uri url)
        {
            string host = url.DnsSafeHost; // an IPv6 address without its brackets
            if (string.Equals(host, "localhost", StringComparison.OrdinalIgnoreCase)) return true;
            IPAddress address;
            if (url.HostNameType != UriHostNameType.IPv4 && url.HostNameType != UriHostNameType.IPv6) return false;
            if (!IPAddress.TryParse(host, out address)) return false;
            if (address.IsIPv4MappedToIPv6) address = address.MapToIPv4();
            return IPAddress.IsLoopback(address);
        }

        static string TakeValue(string[] args, ref int i, string name, string inlineValue)
        {
            if (inlineValue != null) return inlineValue;
            if (i + 1 >= args.Length) throw new UsageException(name + " needs a value");
            i++;
            return args[i];
        }

        static long TakeNumber(string[] args, ref int i, string name, string inlineValue, long min, long max)
        {
            string text = TakeValue(args, ref i, name, inlineValue);
            long n;
            if (text.Length == 0 || text.Length > 15 || !text.All(c => c >= '0' && c <= '9') ||
                !long.TryParse(text, NumberStyles.None, CultureInfo.InvariantCulture, out n) || n < min || n > max)
                throw new UsageException(name + " needs a whole number from " + min + " to " + max + ": " + text);
            return n;
        }

        static string NonEmpty(string s)
        {
            return string.IsNullOrEmpty(s) ? null : s;
        }
    }
}
